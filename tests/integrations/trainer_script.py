"""A stock Hugging Face Trainer script: a tiny GPT-2 on padded variable-length batches.

The one line that differs with stepfx is marked ``# <- stepfx``. Launched by
tests/integrations/test_hf_trainer.py with torchrun on CPU (gloo):

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/integrations/trainer_script.py --stepfx CONFIG --output_dir DIR --results OUT.json

Without ``--stepfx`` it is the same script on the stock Trainer (DDP through
accelerate). ``--reference`` runs the stock Trainer first in the same
processes (one launch instead of two). Rank 0 writes the results as JSON: the
logged losses per step, the evaluation losses (``--eval_steps``: during training too, with
the parameter elements each rank held then), and whether the weights
``save_model`` wrote load back equal to the trained ones.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built here: nothing to download

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import (
    DataCollatorForLanguageModeling,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

VOCAB = 128


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over "t0".."t125" built in memory (no download)."""
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<eos>")))
    tok.pad_token, tok.eos_token = "<pad>", "<eos>"
    return tok


def dataset(n: int, seed: int) -> list[dict]:
    """``n`` sequences of 5..24 tokens: padded batches change length every step."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 25, (n,), generator=g)
    return [{"input_ids": torch.randint(2, VOCAB, (int(k),), generator=g).tolist()} for k in lengths]


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=1, eos_token_id=1, pad_token_id=0))


def digest(state_dict: dict[str, torch.Tensor]) -> str:
    """A hash of the weights: equal digests, bitwise-equal weights."""
    h = hashlib.sha256()
    for key in sorted(state_dict):
        h.update(key.encode())
        h.update(state_dict[key].detach().contiguous().numpy().tobytes())
    return h.hexdigest()


class HeldAtEvaluation(TrainerCallback):
    """How many parameter elements the module held on this rank when each
    evaluation ended (under stepfx's ZeRO-3: its pieces, never the whole model)."""

    def __init__(self):
        self.numels: list[tuple[int, int]] = []  # (step, elements), in order

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self.numels.append((state.global_step, sum(p.numel() for p in model.parameters())))


def train(opts, stepfx_config: str | dict | None, output_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Train as ``opts`` say (through stepfx when ``stepfx_config`` is given);
    the results to report and the trained weights."""
    tok = tokenizer()
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        gradient_accumulation_steps=opts.gradient_accumulation_steps, max_steps=opts.max_steps,
        learning_rate=1e-3, warmup_steps=2, weight_decay=opts.weight_decay, logging_steps=1,
        save_strategy="steps" if opts.save_steps else "no", save_steps=opts.save_steps or 500,
        eval_strategy="steps" if opts.eval_steps else "no", eval_steps=opts.eval_steps or None,
        report_to="none", seed=0, disable_tqdm=True, use_cpu=True,
        # the Trainer's default optimizer (adamw_torch_fused): stepfx traces its reference loop
        dataloader_drop_last=True,
    )
    kwargs = {"model": model(), "args": args, "train_dataset": dataset(64 * opts.gradient_accumulation_steps, 1),
              "eval_dataset": dataset(16, 2), "data_collator": DataCollatorForLanguageModeling(tok, mlm=False),
              "processing_class": tok}
    if stepfx_config:
        from stepfx.integrations.hf import StepfxTrainer

        trainer = StepfxTrainer(**kwargs, stepfx_config=stepfx_config)  # <- stepfx
    else:
        trainer = Trainer(**kwargs)
    held = HeldAtEvaluation()
    trainer.add_callback(held)
    trainer.train(resume_from_checkpoint=opts.resume_from_checkpoint)
    history = [e for e in trainer.state.log_history if "loss" in e]
    trained = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    result = {"losses": {str(e["step"]): e["loss"] for e in history},
              "learning_rates": {str(e["step"]): e["learning_rate"] for e in history},
              "eval_losses": {str(e["step"]): e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e},
              "held_at_evaluation": held.numels, "parameter_numel": sum(p.numel() for p in trainer.model.parameters()),
              "eval_loss": trainer.evaluate()["eval_loss"], "weights": digest(trained)}
    if stepfx_config:  # that the steps went through stepfx, and how
        step = trainer.stepfx_step
        result["stepfx"] = {"updates": step.updates, "zero_stage": step.config.zero_optimization.stage,
                            "variants": len(step.plans)}
    if opts.save_model:
        trainer.save_model(os.path.join(output_dir, "final"))
        if trainer.is_world_process_zero():
            loaded = GPT2LMHeadModel.from_pretrained(os.path.join(output_dir, "final")).state_dict()
            result["saved_weights"] = digest({k: v for k, v in loaded.items() if k in trained})
            result["saved_keys_equal"] = sorted(trained) == sorted(loaded)
    return result, trained


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--stepfx", help="a DeepSpeed JSON config: train through stepfx")
    p.add_argument("--reference", action="store_true", help="also run the stock Trainer first")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--results", required=True)
    p.add_argument("--max_steps", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--save_steps", type=int, default=0)
    p.add_argument("--eval_steps", type=int, default=0, help="evaluate every N steps during training (0: never)")
    p.add_argument("--resume_from_checkpoint")
    p.add_argument("--save_model", action="store_true")
    p.add_argument("--weight_decay", type=float, default=0.01)
    return p.parse_args(argv)


def main() -> None:
    opts = parse_args()
    torch.set_num_threads(1)
    results = {}
    if opts.reference:
        results["reference"], reference = train(opts, None, os.path.join(opts.output_dir, "reference"))
    results["run"], trained = train(opts, opts.stepfx, opts.output_dir)
    if opts.reference:  # the trained weights' largest difference, and their largest magnitude
        results["weights_max_diff"] = max((trained[k] - reference[k]).abs().max().item() for k in reference)
        results["weights_max_abs"] = max(reference[k].abs().max().item() for k in reference)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(opts.results, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

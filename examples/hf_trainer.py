"""A Hugging Face Trainer script trained through stepfx: ZeRO-3 from a DeepSpeed config with "auto" values.

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py

A small GPT-2 (built here, nothing downloaded) learns to count: sequences
"t17 t18 t19 ..." of 8 to 40 tokens, padded per batch, so the batches change
length every step. The script is a stock Trainer script; the stepfx line is
marked. The config's "auto" values come from the TrainingArguments, as with
``TrainingArguments(deepspeed=...)``. Checkpoints go to runs/hf_trainer
(``--resume`` resumes from the last one), the model to runs/hf_trainer/final.
"""
from __future__ import annotations

import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    DataCollatorForLanguageModeling,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    TrainingArguments,
)

from stepfx.integrations.hf import StepfxTrainer

CONFIG = {  # what would go to TrainingArguments(deepspeed=...)
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}
N = 120  # numbers t0 .. t119


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i + 2 for i in range(N)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def counting(tok: PreTrainedTokenizerFast, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        start, length = rng.randrange(N), rng.randint(8, 40)
        texts.append(" ".join(f"t{(start + i) % N}" for i in range(length)))
    return [{"input_ids": ids} for ids in tok(texts)["input_ids"]]


def main() -> None:
    tok = tokenizer()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                       bos_token_id=1, eos_token_id=1, pad_token_id=0))
    args = TrainingArguments(
        output_dir="runs/hf_trainer", per_device_train_batch_size=8, max_steps=60, learning_rate=3e-3,
        warmup_steps=5, logging_steps=10, save_steps=30, eval_strategy="steps", eval_steps=30, report_to="none",
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
    )
    trainer = StepfxTrainer(  # the stock script says Trainer( ... ) and passes CONFIG as TrainingArguments(deepspeed=)
        model=model, args=args, train_dataset=counting(tok, 2000, 0), eval_dataset=counting(tok, 64, 1),
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False), processing_class=tok,
        stepfx_config=CONFIG,
    )
    trainer.train(resume_from_checkpoint="--resume" in sys.argv[1:] or None)
    trainer.save_model(os.path.join(args.output_dir, "final"))  # every rank: ZeRO-3 gathers the pieces
    if trainer.is_world_process_zero():
        print(trainer.stepfx_step.explain().split("\n\n")[0])  # which variants were captured, and the config


if __name__ == "__main__":
    main()

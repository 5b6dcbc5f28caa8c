"""StepfxTrainer: a stock transformers.Trainer script through stepfx, against the same script without it.

The slow tests launch ``trainer_script.py`` with torchrun on 2 CPU ranks
(gloo) twice: launch A trains a tiny GPT-2 for 8 steps with the stock Trainer
(DDP) and then through stepfx (ZeRO-3, every size "auto"), saving a checkpoint
at step 4 and the final model; launch B, a new torchrun, resumes from that
checkpoint for steps 5-8. Batches are padded to their longest sequence, so
their length changes every step and differs between the ranks.

Tolerances: stepfx against the stock Trainer in fp32, 1e-5 relative (the
precision tests' tolerance): the captured graph may sum in another order,
and HF's GPT-2 builds an explicit attention mask under tracing where eager
uses SDPA's own. Today the logged losses are bitwise equal and the weights
differ in their last bits. A resume on the same world size must be bitwise:
same graphs, same state, same batches.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_script.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(SCRIPT)))
REL = 1e-5

ZERO3_AUTO = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}

launches = pytest.mark.xdist_group("hf-trainer-torchrun")  # one test process: the tests share the launches


def _torchrun(*argv: str) -> dict:
    results = argv[argv.index("--results") + 1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           SCRIPT, *argv], env=env, capture_output=True, text=True, timeout=400, check=False)
    if done.returncode != 0:
        pytest.fail(f"torchrun {' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    with open(results) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict:
    """Launch A (stock Trainer, then stepfx with a checkpoint at step 4) and
    launch B (a new torchrun resuming from it). Session-scoped: under
    pytest-xdist the tests of other modules run between these, and a
    module-scoped fixture was torn down and launched again (measured: both
    launches twice, 148 s of the suite)."""
    tmp = tmp_path_factory.mktemp("hf_trainer")
    config = tmp / "ds_zero3_auto.json"
    config.write_text(json.dumps(ZERO3_AUTO))
    first = _torchrun("--stepfx", str(config), "--reference", "--output_dir", str(tmp / "a"), "--max_steps", "8",
                      "--save_steps", "4", "--eval_steps", "4", "--save_model", "--results", str(tmp / "a.json"))
    resumed = _torchrun("--stepfx", str(config), "--output_dir", str(tmp / "b"), "--max_steps", "8",
                        "--resume_from_checkpoint", str(tmp / "a" / "checkpoint-4"), "--eval_steps", "4",
                        "--save_model", "--results", str(tmp / "b.json"))
    return {"first": first, "resumed": resumed, "tmp": tmp}


@pytest.mark.slow
@launches
def test_same_losses_as_the_stock_trainer(runs):
    reference, run = runs["first"]["reference"], runs["first"]["run"]
    assert run["stepfx"]["updates"] == 8 and run["stepfx"]["zero_stage"] == 3
    assert run["stepfx"]["variants"] == 1  # the Trainer's default fused AdamW: its state made before the capture
    assert list(run["losses"]) == [str(s) for s in range(1, 9)]
    assert run["losses"] == pytest.approx(reference["losses"], rel=REL)
    assert run["learning_rates"] == pytest.approx(reference["learning_rates"], rel=REL)
    assert run["eval_loss"] == pytest.approx(reference["eval_loss"], rel=REL)
    assert list(run["eval_losses"]) == ["4", "8"]
    assert run["eval_losses"] == pytest.approx(reference["eval_losses"], rel=REL)
    # the weights, against the largest weight: per tensor would not do, as the attention's key biases get no
    # gradient in exact arithmetic (softmax ignores them) and Adam turns their rounding noise into full steps
    assert runs["first"]["weights_max_diff"] <= REL * runs["first"]["weights_max_abs"]


@pytest.mark.slow
@launches
def test_evaluation_during_training_keeps_the_zero3_pieces(runs):
    # mid-training evaluations run through the step's evaluator: each rank holds its ZeRO-3 pieces (and the
    # parameters under the persistence threshold whole) while it evaluates, never the whole model; the stock
    # Trainer holds every element. The evaluation after train() finds the module made whole by train()'s end.
    reference, run = runs["first"]["reference"], runs["first"]["run"]
    total = run["parameter_numel"]
    assert [step for step, _ in run["held_at_evaluation"]] == [4, 8, 8]
    assert all(held == total for _, held in reference["held_at_evaluation"])
    during = [held for _, held in run["held_at_evaluation"][:2]]
    assert all(0 < held < total // 2 for held in during), (during, total)
    assert run["held_at_evaluation"][2][1] == total


@pytest.mark.slow
@launches
def test_resume_equals_the_uninterrupted_run(runs):
    tmp = runs["tmp"]
    checkpoint = tmp / "a" / "checkpoint-4"
    assert (checkpoint / "latest").read_text() == "global_step4"  # the Trainer's checkpoint holds stepfx's
    assert not (checkpoint / "optimizer.pt").exists()
    whole, resumed = runs["first"]["run"], runs["resumed"]["run"]
    assert resumed["stepfx"]["updates"] == 8  # 4 loaded, 4 run
    later = [str(s) for s in range(5, 9)]
    assert [resumed["losses"][s] for s in later] == [whole["losses"][s] for s in later]
    assert [resumed["learning_rates"][s] for s in later] == [whole["learning_rates"][s] for s in later]
    assert resumed["weights"] == whole["weights"]
    assert resumed["eval_loss"] == whole["eval_loss"]
    assert resumed["eval_losses"]["8"] == whole["eval_losses"]["8"]


@pytest.mark.slow
@launches
def test_save_model_loads_with_from_pretrained(runs):
    for name in ("first", "resumed"):
        run = runs[name]["run"]
        assert run["saved_keys_equal"], name
        assert run["saved_weights"] == run["weights"], name  # bitwise: what was trained is what loads


# -- the config's "auto" values, from TrainingArguments (no training) ---------------------------------------------
def _training_args(tmp_path, **overrides):
    from transformers import TrainingArguments

    given = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": "none", "per_device_train_batch_size": 4,
             "gradient_accumulation_steps": 2, "learning_rate": 3e-4, "adam_beta1": 0.8, "adam_beta2": 0.95,
             "adam_epsilon": 1e-6, "weight_decay": 0.05, "max_grad_norm": 0.5, "warmup_steps": 3}
    return TrainingArguments(**{**given, **overrides})


def test_auto_values_come_from_the_training_arguments(tmp_path):
    from stepfx.integrations.hf_config import trainer_config

    from .trainer_script import model

    config = {**ZERO3_AUTO,
              "optimizer": {"type": "AdamW", "params": dict.fromkeys(("lr", "betas", "eps", "weight_decay"), "auto")},
              "scheduler": {"type": "WarmupDecayLR", "params": dict.fromkeys(
                  ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"), "auto")}}
    cfg = trainer_config(config, _training_args(tmp_path), model(), num_training_steps=20)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (4, 2, 8)
    assert cfg.gradient_clipping == 0.5
    assert (cfg.fp16.enabled, cfg.bf16.enabled) == (False, False)
    assert dict(cfg.optimizer.params) == {"lr": 3e-4, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.05}
    assert dict(cfg.scheduler.params) == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 3,
                                          "total_num_steps": 20}
    zero = cfg.zero_optimization  # the tiny GPT-2's hidden size is 32
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) == (1024, 921, 320)


def test_values_that_disagree_with_the_training_arguments_are_refused(tmp_path):
    from stepfx.config import ConfigError
    from stepfx.integrations.hf_config import trainer_config

    from .trainer_script import model

    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError) as caught:
        trainer_config(config, _training_args(tmp_path), model(), num_training_steps=20)
    message = str(caught.value)
    assert "train_micro_batch_size_per_gpu=8" in message and "gradient_clipping=1.0" in message
    assert "gradient_accumulation_steps" not in message  # 2 is what the arguments say


def test_batch_sizes_left_out_are_the_trainers(tmp_path):
    from stepfx.config import ConfigError
    from stepfx.integrations.hf_config import trainer_config

    args = _training_args(tmp_path)  # 4 per device, 2 accumulation steps, 1 process
    cfg = trainer_config({"zero_optimization": {"stage": 0}}, args, torch.nn.Linear(4, 4), 20)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 4, 2)
    # train_batch_size 8 is the Trainer's too, but alone DeepSpeed derives 1 accumulation step and 8 per device
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=1 where the Trainer's is 2"):
        trainer_config({"train_batch_size": 8, "zero_optimization": {"stage": 0}}, args, torch.nn.Linear(4, 4), 20)


def test_auto_without_a_source_is_refused(tmp_path):
    from stepfx.config import ConfigError
    from stepfx.integrations.hf_config import trainer_config

    args = _training_args(tmp_path)
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        trainer_config({"zero_optimization": {"stage": "auto"}}, args, torch.nn.Linear(4, 4), 20)
    with pytest.raises(ConfigError, match="hidden size"):
        trainer_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, args,
                       torch.nn.Linear(4, 4), 20)


# -- the config's optimizer and scheduler blocks (one process) ------------------------------------------------------
BLOCKS = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 1},
    "optimizer": {"type": "AdamW", "params": dict.fromkeys(("lr", "betas", "eps", "weight_decay"), "auto")},
    "scheduler": {"type": "WarmupDecayLR", "params": {**dict.fromkeys(
        ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"), "auto"), "warmup_type": "linear"}},
}


@pytest.mark.slow
def test_optimizer_and_scheduler_blocks(tmp_path):
    """The blocks built as DeepSpeed builds them, stepfx advancing the
    schedule inside the step: the same run as the stock Trainer given that
    optimizer and scheduler. The Trainer logs the learning rate after the
    update; stepfx (like DeepSpeed's engine) has advanced the schedule by
    then, so it logs the next step's, as the DeepSpeed integration does."""
    from transformers import DataCollatorForLanguageModeling, Trainer

    from stepfx.integrations.hf import StepfxTrainer
    from stepfx.integrations.hf_config import trainer_config
    from stepfx.optimizer_builder import build_optimizer
    from stepfx.schedules import WarmupDecayLR, build_scheduler

    from .trainer_script import dataset, model, tokenizer

    def run(cls, name, **kwargs):
        args = _training_args(tmp_path / name, gradient_accumulation_steps=1, max_steps=4, learning_rate=1e-3,
                              warmup_steps=2, logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
                              dataloader_drop_last=True)
        net = model()
        if cls is Trainer:  # the same optimizer and scheduler, built by hand and stepped by the Trainer's loop
            cfg = trainer_config(BLOCKS, args, net, 4)
            optimizer = build_optimizer(cfg.optimizer, [p for p in net.parameters() if p.requires_grad])
            kwargs["optimizers"] = (optimizer, build_scheduler(cfg.scheduler, optimizer))
        trainer = cls(model=net, args=args, train_dataset=dataset(16, 1),
                      data_collator=DataCollatorForLanguageModeling(tokenizer(), mlm=False), **kwargs)
        trainer.train()
        history = [e for e in trainer.state.log_history if "loss" in e]
        return trainer, [e["loss"] for e in history], [e["learning_rate"] for e in history]

    ours, losses, lrs = run(StepfxTrainer, "stepfx", stepfx_config=BLOCKS)
    _, ref_losses, ref_lrs = run(Trainer, "reference")
    assert isinstance(ours.stepfx_step.lr_scheduler, WarmupDecayLR)
    assert losses == pytest.approx(ref_losses, rel=REL)
    assert lrs[:-1] == pytest.approx(ref_lrs[1:], rel=REL)
    assert ours.stepfx_step.updates == 4

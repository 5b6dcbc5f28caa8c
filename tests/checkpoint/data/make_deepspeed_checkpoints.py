"""Write the DeepSpeed checkpoints that tests/checkpoint/test_deepspeed_import.py reads.

Run by hand, never by the suite (the suite must not need DeepSpeed), with
the real ``deepspeed`` package in a virtualenv of its own::

    python3 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0 numpy safetensors
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install deepspeed==0.19.8
    /tmp/dsvenv/bin/python tests/checkpoint/data/make_deepspeed_checkpoints.py

DeepSpeed builds its CPU shared-memory communication op with ninja and the
C++ compiler at the first run. For each ZeRO stage 1, 2, 3 and world size
1, 2 it trains :class:`Tiny` (bf16 compute, fp32 masters, torch's AdamW as
the client optimizer, two parameter groups, DeepSpeed's WarmupLR, a tied
weight, a frozen layer, an integer buffer, numels that are not multiples of
the world size) on the CPU with gloo for three updates and saves
``deepspeed_z<stage>_ws<N>/`` next to this file:

    latest, global_step3/...        DeepSpeed's own checkpoint, as it wrote it
                                    (less the zero_to_fp32.py and zero_to_torch.py
                                    it copies in: code, not data)
    expected_model.safetensors      what DeepSpeed's zero_to_fp32 consolidates
                                    from that checkpoint (tied names once: the
                                    first of each tied set)
    expected_optim.safetensors      "<param>/<exp_avg|exp_avg_sq>": each trained
                                    parameter's whole Adam state, as DeepSpeed's
                                    safe_get_full_optimizer_state gathers it from
                                    the live engine
    expected.json                   the DeepSpeed version, global_steps, the
                                    parameter groups and the tied names

bf16 only: DeepSpeed refuses fp16 on a CPU without oneDNN fp16 ("Type fp16 is
not supported on your device"), which is what the machine that wrote these had.

Everything is tiny (a few hundred elements): the six directories take
under 300 KB together. A second run gives the same files but for rank 1's
of ZeRO-3 on two ranks (gloo's reductions), each set consistent in itself.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported: it picks its accelerator then

import torch
import torch.multiprocessing as mp
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3


class Tiny(nn.Module):
    """Every shape odd on purpose: ZeRO pads partitions to the world size."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 5)
        self.norm = nn.LayerNorm(5)
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 5)
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(5, 11, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models tie input and output embeddings
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.register_buffer("temperature", torch.tensor([1.5]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        h = self.norm(self.embed(ids))
        h = h + self.fc2(torch.relu(self.fc1(h))) + self.frozen(h)
        return self.head(h) / self.temperature


def _config(stage: int, precision: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        precision: {"enabled": True},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64},
        "gradient_clipping": 1.0,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5,
                                                      "warmup_type": "linear"}},
        "steps_per_print": 1000,
    }


def _worker(rank: int, world: int, port: int, stage: int, precision: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    import deepspeed
    from deepspeed.utils import safe_get_full_optimizer_state
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Tiny()
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and all(p is not q for q in decay)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=0.01, betas=(0.8, 0.95), eps=1e-6)
    names = {id(p): n for n, p in model.named_parameters()}
    group_names = [[names[id(p)] for p in g_["params"]] for g_ in optimizer.param_groups]  # DeepSpeed swaps them out
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=_config(stage, precision))
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(STEPS):
        ids = torch.randint(0, 11, (2, 4), generator=g)
        logits = engine(ids)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out)

    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        # ZeRO 1/2 link each parameter to its optimizer state once, after the step of the first parameter group,
        # before the other groups have any state: link again now that every group has some
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    optim = {}
    for n, p in named:
        for key in ("exp_avg", "exp_avg_sq"):
            optim[f"{n}/{key}"] = safe_get_full_optimizer_state(p, key).detach().float().cpu().contiguous()
    torch.distributed.barrier()
    if rank == 0:
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's recovery scripts: code, not data
            if os.path.exists(os.path.join(out, script)):
                os.remove(os.path.join(out, script))
        with open(os.path.join(out, "latest")) as f:
            tag = f.read().strip()
        consolidated = get_fp32_state_dict_from_zero_checkpoint(out, tag=tag)
        kept, tied = {}, {}
        for name, t in consolidated.items():
            first = next((k for k, v in kept.items() if v is t), None)
            if first is None:
                kept[name] = t
            else:
                tied[name] = first
        save_file({k: v.contiguous() for k, v in kept.items()}, os.path.join(out, "expected_model.safetensors"))
        save_file(optim, os.path.join(out, "expected_optim.safetensors"))
        groups = [{"lr": g_["lr"], "weight_decay": g_["weight_decay"], "betas": list(g_["betas"]), "params": ns}
                  for g_, ns in zip(optimizer.param_groups, group_names)]
        with open(os.path.join(out, "expected.json"), "w") as f:
            json.dump({"deepspeed": deepspeed.__version__, "torch": torch.__version__, "zero_stage": stage,
                       "world_size": world, "precision": precision, "global_steps": engine.global_steps,
                       "skipped_steps": engine.skipped_steps, "loss_scale": engine.optimizer.loss_scale, "tag": tag,
                       "tied": tied, "param_groups": groups}, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    wanted = {f"z{s}_ws{w}": (s, w, "bf16") for s in (1, 2, 3) for w in (1, 2)}
    if len(sys.argv) > 1:
        wanted = {k: v for k, v in wanted.items() if k in sys.argv[1:]}
    for name, (stage, world, precision) in wanted.items():
        out = os.path.join(HERE, f"deepspeed_{name}")
        shutil.rmtree(out, ignore_errors=True)
        mp.start_processes(_worker, args=(world, _free_port(), stage, precision, out), nprocs=world,
                           start_method="spawn")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""make demo: a small GPT trained with ZeRO-3 on 2 local processes.

The corpus is the Python standard library's own source (every machine with
Python has it), read as bytes: a 256-symbol vocabulary, no tokenizer to
download. Launch with torchrun (``make demo`` does):

    torchrun --standalone --nproc_per_node 2 examples/demo_gpt.py

Rank 0 prints the loss as it falls and, at the end, ``explain()``: the
passes, the ZeRO layout, memory and communication per rank (the full
per-rank graph goes to dumps/demo_explain_rank0.txt).
"""
from __future__ import annotations

import os
import sysconfig
import time

import torch

import stepfx
from stepfx.testing.models import GPT, GPTConfig, lm_loss

STEPS = int(os.environ.get("DEMO_STEPS", "200"))
SEQ = 64
CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_zero3.json")


def corpus(limit_bytes: int = 4_000_000) -> torch.Tensor:
    """The standard library's .py files, concatenated, as a byte tensor."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "site-packages", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
                chunks.append(data)
                total += len(data)
                if total >= limit_bytes:
                    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


@stepfx.parallelize(CONFIG)
def train_step(model, optimizer, tokens):
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def main() -> None:
    torch.manual_seed(0)  # the same initial model on every rank
    model = GPT(GPTConfig(vocab_size=256, seq_len=SEQ, d_model=128, n_layers=4, n_heads=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    data = corpus()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro = 8
    g = torch.Generator().manual_seed(1234 + rank)  # each rank reads its own samples
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"stepfx demo: GPT {params:,} params, {world} ranks, ZeRO-3 ({CONFIG}), corpus {len(data):,} bytes of Python stdlib")
    start = time.time()
    first = None
    for step in range(1, STEPS + 1):
        idx = torch.randint(0, len(data) - SEQ - 1, (micro,), generator=g)
        batch = torch.stack([data[i : i + SEQ + 1] for i in idx])
        loss = train_step(model, optimizer, batch)
        first = first if first is not None else loss.item()
        if rank == 0 and (step == 1 or step % 25 == 0):
            print(f"step {step:4d}  loss {loss.item():.3f}  ({time.time() - start:.1f} s)", flush=True)
    text = train_step.explain()
    if rank == 0:
        os.makedirs("dumps", exist_ok=True)
        with open("dumps/demo_explain_rank0.txt", "w") as f:
            f.write(text)
        print()
        print(text.split("final step graph")[0].rstrip())
        print("\n(full per-rank graph in dumps/demo_explain_rank0.txt)")
        print(f"loss {first:.3f} -> {loss.item():.3f} in {STEPS} steps, {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()

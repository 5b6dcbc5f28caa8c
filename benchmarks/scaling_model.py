"""Scaling on paper: how stepfx's ZeRO stages would fare on 8, 64 and 512
H200s for GPT-shaped models of 1.3B, 8B and 70B parameters, and what it
would need to stay compute-bound.

    python3 benchmarks/scaling_model.py [--check results/2026-11-30_train_gpt_1.3B_h200x2.jsonl]

The model (every number is an assumption stated here; no GPU is used):

- **Compute** per GPU per optimizer step: (6N + 12 L d seq) FLOPs per token
  (BENCHMARKS.md) x the GPU's tokens, at 74% of the H200's 989 TFLOP/s —
  the measured limit of the workload's GEMMs and attention (BENCHMARKS.md).
  Backward is 2/3 of it.
- **Communication** per GPU, ring collectives: an all-gather or
  reduce-scatter of S bytes moves S (n-1)/n through each GPU; all-reduce
  twice that. bf16 parameters are gathered; gradients are reduced in fp32
  (the default; ``communication_data_type`` bf16 halves it). Per step:
  stage 0 all-reduces the gradients; stages 1-2 reduce-scatter them and
  all-gather the updated bf16 parameters; stage 3 all-gathers the bf16
  parameters for forward and again for backward and reduce-scatters the
  gradients — at every micro-batch, so accumulation does not amortize it.
- **Bandwidth** (bus bandwidth per GPU, large messages): inside a node of 8
  over NVLink, the 2-GPU measurements of BENCHMARKS.md (all-gather 276,
  reduce-scatter 259, all-reduce 330 GB/s); across nodes, one 400 Gb/s NIC
  per GPU: 50 GB/s, 45 GB/s usable. A collective over ranks on several
  nodes runs at the slower. Each collective also costs a latency of 30 us
  inside a node, 60 us across (ring steps add log-ish terms; ignored).
- **Overlap**: parameter gathers overlap all compute, gradient reductions
  the backward; the exposed time is what exceeds them.
- **Memory** per GPU: model states as ZeRO counts them (16 bytes per
  parameter: bf16 copy 2, grad 4 fp32 in stepfx (DeepSpeed: 2), master 4,
  Adam 8) divided by the sharding, plus activations at 28 bytes per token
  per layer per d_model (measured: the 1.3B step on one H200 peaks at 30.1
  GiB with fused cross-entropy), against 141 GB x 0.9.
- **Hierarchy** (``hsdp``): parameters and optimizer state sharded inside
  each node (8 GPUs), replicated across nodes; gradients reduce-scattered
  inside the node, then all-reduced across nodes on the 1/8 shard. Only the
  last crosses the network: 2 x 4 x N/8 bytes per GPU per step (fp32).

``--check`` compares the model with stepfx's measured 2-GPU runs: the bf16
ZeRO-3 run of ``overlap_profile.py`` (NCCL kernel time per step) or the
1.3B rows of ``train_gpt.py`` (step time, MFU, memory per stage).
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

PEAK = 989e12
EFFICIENCY = 0.74  # of PEAK: the workload's GEMM + attention limit (BENCHMARKS.md)
GPU_MEMORY = 141e9 * 0.9
INTRA = {"all_gather": 276e9, "reduce_scatter": 259e9, "all_reduce": 330e9}
INTER = {"all_gather": 45e9, "reduce_scatter": 45e9, "all_reduce": 45e9}
LATENCY = {"intra": 30e-6, "inter": 60e-6}
NODE = 8
ACT_BYTES = 28  # per token x layer x d_model, with stepfx's fused cross-entropy (measured at 1.3B)


@dataclass(frozen=True)
class Model:
    name: str
    d: int
    layers: int
    vocab: int = 50304
    seq: int = 2048
    micro_batch: int = 4

    @property
    def params(self) -> int:
        return 12 * self.layers * self.d**2 + self.vocab * self.d

    @property
    def flops_per_token(self) -> float:
        return 6 * self.params + 12 * self.layers * self.d * self.seq


MODELS = (
    Model("1.3B", 2048, 24, micro_batch=4),
    Model("8B", 4096, 40, micro_batch=2),
    Model("70B", 8192, 86, micro_batch=1),
)


def collective_time(kind: str, size_bytes: float, ranks: int, buckets: int, across: bool | None = None) -> float:
    """Seconds for a ring collective of ``size_bytes`` (the full tensor)
    over ``ranks`` GPUs in ``buckets`` pieces; ``across``: over the network
    (default: when the ranks do not fit in one node)."""
    if ranks <= 1:
        return 0.0
    across = ranks > NODE if across is None else across
    bw = (INTER if across else INTRA)[kind]
    moved = size_bytes * (ranks - 1) / ranks * (2 if kind == "all_reduce" else 1)
    return moved / bw + buckets * LATENCY["inter" if across else "intra"]


def estimate(m: Model, gpus: int, stage: int, group: int | None = None, bucket: float = 100e6, accumulation: int = 1,
             micro_batch: int | None = None, checkpointing: bool = False):
    """One optimizer step (``accumulation`` micro-batches) per GPU: seconds
    of compute and of communication, what of it is exposed, memory, MFU.
    ``group``: shard over groups of that many GPUs, replicated across
    groups (None: over all GPUs). ``checkpointing``: recompute each block's
    activations in backward (a third more compute; only block inputs kept)."""
    n = m.params
    mb = micro_batch or m.micro_batch
    tokens = mb * m.seq * accumulation
    useful = m.flops_per_token * tokens / (PEAK * EFFICIENCY)
    compute = useful * (4 / 3 if checkpointing else 1)
    backward = compute - useful / 3
    grads, params16 = 4 * n, 2 * n
    group = gpus if group is None or group >= gpus else group
    hier = group < gpus
    shard = group
    per = lambda size: max(1, math.ceil(size / bucket))  # noqa: E731  (buckets of that many bytes)
    gather = reduce = 0.0
    if stage == 0:
        reduce = collective_time("all_reduce", grads, gpus, per(grads))
    else:
        # ZeRO-2/3 reduce gradients at every micro-batch (no full gradient is kept); ZeRO-1 once
        times = accumulation if stage >= 2 else 1
        reduce = collective_time("reduce_scatter", grads, shard, per(grads)) * times
        if hier:  # the group's shard, all-reduced across groups once per step
            reduce += collective_time("all_reduce", grads / group, gpus // group, per(grads / group), across=True)
        gather = collective_time("all_gather", params16, shard, per(params16)) * (2 * accumulation if stage == 3 else 1)
    if stage == 3:  # gathers under all compute, reductions under the backward
        exposed = max(0.0, gather + reduce - compute, reduce - backward)
    else:  # stages 1-2 gather the updated parameters after the update, with nothing to hide under
        exposed = gather + max(0.0, reduce - backward)
    states = {0: 16 * n, 1: 4 * n + 12 * n / shard, 2: 2 * n + 14 * n / shard, 3: 16 * n / shard}[stage]
    activations = (2 * 2 if checkpointing else ACT_BYTES) * mb * m.seq * m.layers * m.d
    step = compute + exposed
    return {
        "model": m.name, "gpus": gpus, "stage": stage, "group": group, "micro_batch": mb, "checkpointing": checkpointing,
        "accumulation": accumulation, "compute_s": round(compute, 4), "gather_s": round(gather, 4),
        "reduce_s": round(reduce, 4), "exposed_s": round(exposed, 4), "mfu": round(EFFICIENCY * useful / step, 3),
        "memory_gb": round((states + activations) / 1e9, 1), "fits": states + activations <= GPU_MEMORY,
    }


def plan(m: Model, gpus: int) -> dict:
    """The simplest configuration that fits and keeps exposed communication
    under 5% of compute: lower stage first, then sharding inside a node,
    no recomputation, the smallest batch per GPU; else the best MFU found."""
    tried = []
    groups = [None] + [g for g in (NODE, 2 * NODE, 4 * NODE, 8 * NODE) if g < gpus]
    for checkpointing in (False, True):
        for stage in (0, 1, 2, 3):
            for group in groups:
                for mb in (m.micro_batch, 2 * m.micro_batch, 4 * m.micro_batch, 8 * m.micro_batch):
                    for accumulation in (1, 2, 4, 8, 16):
                        r = estimate(m, gpus, stage, group, accumulation=accumulation, micro_batch=mb,
                                     checkpointing=checkpointing)
                        tried.append(r)
                        if r["fits"] and r["exposed_s"] <= 0.05 * r["compute_s"]:
                            return {**r, "verdict": "compute-bound"}
    fitting = [r for r in tried if r["fits"]]
    if not fitting:
        return {"model": m.name, "gpus": gpus, "verdict": "does not fit: needs tensor/pipeline parallelism or offload"}
    return {**max(fitting, key=lambda r: r["mfu"]), "verdict": "communication-bound"}


def min_bucket(across: bool) -> float:
    """Bytes per collective that keep its latency under 5% of its transfer time."""
    bw = (INTER if across else INTRA)["reduce_scatter"]
    return 20 * bw * LATENCY["inter" if across else "intra"]


def check(path: str) -> list[str]:
    """The model against stepfx's measured 2-GPU runs: ``overlap_profile.py``'s
    bf16 ZeRO-3 rows (collective time) and ``train_gpt.py``'s stepfx rows
    for the 1.3B (step time, MFU, memory, and collective time where profiled)."""
    lines = []
    for line in open(path):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if str(r.get("system", "")).startswith("stepfx-") and "step_ms" in r:
            lines.append(_check_train(r))
            continue
        if r.get("stage") != 3 or not r.get("overlap") or "nccl_kernel_ms_per_step" not in r:
            continue
        # "GPT d1024 L8 seq1024 batch4 bf16"
        parts = dict((p[0], p[1:]) for p in r["model"].split()[1:4])
        d, layers, seq = int(parts["d"]), int(parts["L"]), int(r["model"].split("seq")[1].split()[0])
        m = Model("measured", d, layers, seq=seq, micro_batch=4)
        est = estimate(m, r["world_size"], 3, bucket=500e6)
        predicted = (est["gather_s"] + est["reduce_s"]) * 1e3
        lines.append(f"{r['model']} on {r['world_size']} GPUs, ZeRO-3: predicted {predicted:.2f} ms of collectives per "
                     f"step at full bandwidth, measured {r['nccl_kernel_ms_per_step']} ms of NCCL kernels "
                     f"(x{r['nccl_kernel_ms_per_step'] / predicted:.1f}: kernels also count their wait for the peer, "
                     f"and small buckets run below peak bandwidth)")
    return lines


def _check_train(r: dict) -> str:
    """One ``train_gpt.py`` row (stepfx at one ZeRO stage) against the model."""
    stage = int(r["system"].split("-")[1])
    m = next(x for x in MODELS if x.name == r["size"])
    m = Model(m.name, m.d, m.layers, seq=r["seq"], micro_batch=r["micro_batch"])
    est = estimate(m, r["world"], stage, bucket=50e6 * 4)
    step_ms = (est["compute_s"] + est["exposed_s"]) * 1e3
    measured = r.get("timing", {}).get("median_ms", r["step_ms"])
    out = (f"{r['size']} stepfx ZeRO-{stage} on {r['world']} GPUs: step predicted {step_ms:.1f} ms, measured "
           f"{measured:.1f} (median; x{measured / step_ms:.2f}), MFU {est['mfu']:.1%} vs {r['mfu']:.1%}, "
           f"memory {est['memory_gb']:.1f} GB vs {r.get('peak_alloc_gib', float('nan')) * 2**30 / 1e9:.1f} GB")
    nccl = r.get("profile", {}).get("nccl")
    if nccl:
        out += (f", collectives {(est['gather_s'] + est['reduce_s']) * 1e3:.1f} ms at full bandwidth vs {nccl:.1f} ms "
                "of NCCL kernels (under the profiler; kernels include their wait for the peer)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", default=None)
    args = ap.parse_args()
    print(f"{'model':>5} {'GPUs':>5}  {'verdict':<19} {'stage':>5} {'shard':>5} {'mb':>3} {'accum':>5} {'ckpt':>4} "
          f"{'compute s':>9} {'gather s':>8} {'reduce s':>8} {'exposed':>7} {'MFU':>5} {'mem GB':>6}")
    for m in MODELS:
        for gpus in (2, 8, 64, 512):
            r = plan(m, gpus)
            if "stage" not in r:
                print(f"{m.name:>5} {gpus:>5}  {r['verdict']}")
                continue
            print(f"{m.name:>5} {gpus:>5}  {r['verdict']:<19} {r['stage']:>5} {r['group']:>5} {r['micro_batch']:>3} "
                  f"{r['accumulation']:>5} {'yes' if r['checkpointing'] else 'no':>4} {r['compute_s']:>9} "
                  f"{r['gather_s']:>8} {r['reduce_s']:>8} {r['exposed_s']:>7} {r['mfu']:>5} {r['memory_gb']:>6}")
    print()
    print(f"buckets: >= {min_bucket(False) / 1e6:.0f} MB inside a node, >= {min_bucket(True) / 1e6:.0f} MB across nodes "
          "(latency under 5% of each collective's transfer)")
    if args.check:
        print()
        print("\n".join(check(args.check)))


if __name__ == "__main__":
    main()

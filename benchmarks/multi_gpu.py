"""Multi-GPU runs (issue 23): tensor and pipeline parallelism against their
peers in one torchrun invocation, and their correctness over NCCL.

    torchrun --standalone --nproc_per_node 2 benchmarks/multi_gpu.py --mode tp --size 1.3B --out $OUT
    torchrun --standalone --nproc_per_node 2 benchmarks/multi_gpu.py --mode pp --size 6.6B --micro 8 --out $OUT
    torchrun --standalone --nproc_per_node 2 benchmarks/multi_gpu.py --mode check --out $OUT
    torchrun --standalone --nproc_per_node 2 benchmarks/multi_gpu.py --mode tp --device cpu --size tiny   # smoke (gloo)

``--mode tp`` (every rank one tensor-parallel group: TP = world), systems:

- ``stepfx-tp``: ``{"tensor_parallel": {"autotp_size": world}}`` on the
  unchanged model (the Megatron pairs found on the graph), bf16 with fp32
  masters, clipping 1.0, AdamW; ``stepfx-tp-no-overlap``: the same with
  ``tp_overlap_comm: false`` (each TP collective waited where issued: the
  A/B of the backward overlap); ``stepfx-tp-sp``: with sequence parallelism;
- ``dtensor-tp``: a hand-written ``parallelize_module`` plan of the same
  model (ColwiseParallel q/k/v and MLP up, RowwiseParallel attention output
  and MLP down; the fused q/k/v weight's rows permuted so each rank's slice
  is its heads' q, k and v; the block's forward with per-rank head counts),
  autocast bf16, clipping, AdamW (foreach over DTensors);
- ``deepspeed-autotp``: reported unavailable (its presets cover Hugging Face
  architectures, not this model).

``--mode pp`` (every rank one stage; ``--micro`` micro-batches a step of
``--batch`` rows each), systems:

- ``stepfx-pp-gpipe``, ``stepfx-pp-1f1b``, ``stepfx-pp-zb`` (ZB-H1):
  ``{"pipeline": {"stages": world}, "gradient_accumulation_steps": micro,
  "stepfx": {"pipeline": {"schedule": ...}}}``, the step called once with the
  whole batch;
- ``torch-gpipe``, ``torch-1f1b``: torch.distributed.pipelining's schedules
  on the same model cut by hand into equal numbers of blocks (the first
  stage with the embeddings, the last with the final norm and the head,
  whose weight is an untied copy there), autocast bf16, clipping over all
  stages, AdamW.

Reported (rank 0, JSON lines to ``$OUT/multi_gpu.jsonl``): tokens/s (per
step's tokens, and per GPU), MFU per GPU, peak allocated memory (max over
ranks), step time, warm-up; for the pipeline the schedule's theoretical
bubble ((p - 1) / (m + p - 1) for GPipe/1F1B) and stepfx's predicted one
(explain()). The measured bubble needs each stage's compute time alone:
not yet (compare the step time with a one-GPU run of the same batch).

``--mode check``: tiny GPT, fp32 and bf16, SGD with momentum, clipping 1.0,
4 steps of stepfx TP (world) and PP (world stages, 1F1B, 4 micro-batches)
over this backend against the single-device step on rank 0 (same batches;
bf16 against DeepSpeed-style mixed precision on one device): the largest
relative parameter difference (normwise per tensor) and the losses; fp32
must be within 1e-5; bf16's distance from the fp32 step at most twice the
one-device bf16 step's.

Whether the GPUs ran at their power cap: ``nvidia-smi -q -d POWER`` before
and after (the shell script records it).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import stepfx  # noqa: E402
from single_gpu import stepfx_step, sync, timed  # noqa: E402
from train_gpt import init_distributed  # noqa: E402
from stepfx.testing.models import GPT, gpt_config, lm_loss  # noqa: E402

PEAK_FLOPS = 989e12  # H200 dense bf16
ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
SYSTEMS = {"tp": "stepfx-tp,stepfx-tp-no-overlap,stepfx-tp-sp,dtensor-tp,deepspeed-autotp",
           "pp": "stepfx-pp-gpipe,stepfx-pp-1f1b,stepfx-pp-zb,torch-gpipe,torch-1f1b"}


class Unavailable(Exception):
    """A peer that cannot run here."""


def _adamw(params, device, fused=True):
    return torch.optim.AdamW(params, fused=fused and device.type == "cuda", **ADAMW)


def _clip(params, max_norm: float = 1.0) -> None:
    """clip_grad_norm_ over plain and DTensor gradients together (torch's refuses the mix): a DTensor's
    squared norm is reduced over its mesh, and its local shard scaled."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    total = None
    for g in grads:
        sq = g.float().pow(2).sum()
        if isinstance(sq, DTensor):
            sq = sq.full_tensor()
        total = sq if total is None else total + sq
    if total is None:
        return
    scale = (max_norm / (total.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        (g._local_tensor if isinstance(g, DTensor) else g).mul_(scale)


def _eager(model, optimizer, tokens):
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    _clip(list(model.parameters()))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


# -- tensor parallelism -------------------------------------------------------------------------------


def _stepfx_config(args, world, **extra):
    return {"bf16": {"enabled": True}, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": args.batch,
            "stepfx": {"codegen": args.codegen == "on"} if args.codegen != "default" else {}, **extra}


def _tp_block_forward(block, x):
    """GPT's block with this rank's heads: its q/k/v slice holds its heads' q, k and v (see _permute_qkv)."""
    b, t, _ = x.shape
    q, k, v = block.qkv(block.ln1(x)).chunk(3, dim=2)
    heads = block.n_heads_local
    q, k, v = (z.view(b, t, heads, -1).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + block.proj(y.transpose(1, 2).reshape(b, t, -1))
    return x + block.fc_out(F.gelu(block.fc(block.ln2(x)), approximate="tanh"))


def _permute_qkv(weight, bias, tp):
    """Rows [q | k | v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: ColwiseParallel's contiguous slices are then each
    rank's heads' q, k and v (the same function, reordered)."""
    def order(t):
        q, k, v = t.chunk(3, dim=0)
        return torch.cat([torch.cat([z.chunk(tp, dim=0)[r] for z in (q, k, v)]) for r in range(tp)])

    with torch.no_grad():
        weight.copy_(order(weight))
        if bias is not None:
            bias.copy_(order(bias))


def build_tp(kind, cfg, args, device, world):
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if kind.startswith("stepfx-tp"):  # -no-overlap: TP collectives waited where issued (A/B of tp_overlap_comm)
        tp = {"autotp_size": world, **({"tp_overlap_comm": False} if kind == "stepfx-tp-no-overlap" else {})}
        extra = {"tensor_parallel": tp}
        if kind == "stepfx-tp-sp":
            extra["stepfx"] = {**_stepfx_config(args, world).get("stepfx", {}), "sequence_parallel": True}
        step = stepfx.parallelize({**_stepfx_config(args, world), **extra})(stepfx_step)
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        return (lambda tokens: step(model, optimizer, tokens)), step
    if kind == "dtensor-tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            if block.n_heads % world:
                raise Unavailable(f"{block.n_heads} heads do not split over {world} ranks")
            _permute_qkv(block.qkv.weight, block.qkv.bias, world)
            parallelize_module(block, mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                             "fc": ColwiseParallel(), "fc_out": RowwiseParallel()})
            block.n_heads_local = block.n_heads // world
            block.forward = _tp_block_forward.__get__(block)
        optimizer = _adamw(model.parameters(), device, fused=False)  # foreach over DTensors
        return (lambda tokens: _eager(model, optimizer, tokens)), None
    if kind == "deepspeed-autotp":
        raise Unavailable("DeepSpeed AutoTP's presets cover Hugging Face architectures, not this GPT")
    raise ValueError(f"unknown tp system {kind!r}")


# -- pipeline parallelism ---------------------------------------------------------------------------------


class _Stage(nn.Module):
    """The blocks [lo, hi) of ``model``, with the embeddings first and the final norm and head last."""

    def __init__(self, model: GPT, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.tok = model.tok if first else None
        self.pos = model.pos if first else None
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        self.ln_f = model.ln_f if last else None
        if last:  # the head's weight is tied to the embedding, which lives on the first stage: a copy here
            self.head = nn.Linear(model.cfg.d_model, model.cfg.vocab_size, bias=False)
            with torch.no_grad():
                self.head.weight.copy_(model.tok.weight)

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            if self.first:
                x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
            for block in self.blocks:
                x = block(x)
            if self.last:
                x = self.head(self.ln_f(x))
        return x


def build_pp(kind, cfg, args, device, world):
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if kind.startswith("stepfx-pp-"):
        schedule = {"gpipe": "gpipe", "1f1b": "1f1b", "zb": "zero_bubble"}[kind.rsplit("-", 1)[1]]
        config = _stepfx_config(args, world, pipeline={"stages": world}, gradient_accumulation_steps=args.micro)
        config["stepfx"]["pipeline"] = {"schedule": schedule}
        step = stepfx.parallelize(config)(stepfx_step)
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        return (lambda tokens: step(model, optimizer, tokens)), step
    if kind.startswith("torch-"):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        rank = dist.get_rank()
        per = cfg.n_layers // world
        lo, hi = rank * per, (cfg.n_layers if rank == world - 1 else (rank + 1) * per)
        module = _Stage(model, lo, hi, rank == 0, rank == world - 1).to(device)
        del model
        stage = PipelineStage(module, rank, world, device)
        schedule_cls = {"torch-gpipe": ScheduleGPipe, "torch-1f1b": Schedule1F1B}[kind]

        def loss_fn(logits, targets):
            return lm_loss(logits, targets)

        schedule = schedule_cls(stage, args.micro, loss_fn=loss_fn)
        params = list(module.parameters())
        optimizer = _adamw(params, device)

        def run(tokens):
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            losses: list = []
            if rank == 0:
                schedule.step(inputs)
            elif rank == world - 1:
                schedule.step(target=targets, losses=losses)
            else:
                schedule.step()
            # clipping over every stage's gradients: the squared norms summed over the pipeline
            sq = torch.stack([p.grad.float().pow(2).sum() for p in params if p.grad is not None]).sum()
            dist.all_reduce(sq)
            scale = (1.0 / (sq.sqrt() + 1e-6)).clamp(max=1.0)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
            dist.broadcast(loss, src=world - 1)
            return loss

        return run, None
    raise ValueError(f"unknown pp system {kind!r}")


# -- measuring ---------------------------------------------------------------------------------------------


def _matmul_params(cfg) -> int:
    with torch.device("meta"):
        return GPT(cfg).matmul_params()


def measure(kind, cfg, args, device, rank, world) -> dict:
    g = torch.Generator().manual_seed(1000)  # every rank the same batch: TP groups and pipelines share it
    rows = args.batch * (args.micro if args.mode == "pp" else 1)
    batches = [torch.randint(0, cfg.vocab_size, (rows, args.seq + 1), generator=g).to(device) for _ in range(4)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    build = build_tp if args.mode == "tp" else build_pp
    train, step = build(kind, cfg, args, device, world)
    start = time.perf_counter()
    for i in range(args.warmup):
        loss = train(batches[i % 4])
    sync(device)
    warmup_s = time.perf_counter() - start
    times, loss = timed(lambda i: train(batches[i % 4]), args.steps, device)
    step_s = times["step_ms"] / 1e3
    tokens = rows * args.seq / step_s  # one model replica over all the GPUs
    flops_per_token = 6 * _matmul_params(cfg) + 12 * cfg.n_layers * cfg.d_model * args.seq
    row = {"system": kind, "gpus": world, "step_ms": round(step_s * 1e3, 2), "tokens_per_s": round(tokens),
           "tokens_per_s_per_gpu": round(tokens / world), "mfu": round(flops_per_token * tokens / world / PEAK_FLOPS, 4),
           "warmup_s": round(warmup_s, 1), "loss": float(loss.detach().float()), "timing": times}
    if device.type == "cuda":
        row["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if step is not None:
        row["captures"] = len({id(p) for p in step.plans})
        if args.mode == "pp":
            text = step.explain()
            row["predicted_bubble"] = next((line.strip() for line in text.splitlines() if "predicted bubble" in line), None)
    if args.mode == "pp":  # GPipe's and 1F1B's (p - 1) / (m + p - 1); ZB-H1 about a third of it
        p, m = world, args.micro
        row["theoretical_bubble_1f1b"] = round((p - 1) / (m + p - 1), 4)
    del train, step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


# -- correctness over the backend --------------------------------------------------------------------------


def _reference_step(model, optimizer, tokens):
    """The single-device step stepfx's config stands for: the whole batch, clipping 1.0 on the (fp32) gradients."""
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _sgd(model):
    # SGD with momentum: Adam would turn last-bit differences of near-zero gradients into lr-sized ones
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def check(args, device, rank, world) -> list[dict]:
    """stepfx TP (with and without sequence parallelism) and PP on this backend against the single-device
    step (rank 0): fp32 within 1e-5 relative
    (normwise per tensor); bf16 no further from the fp32 step than twice DeepSpeed-style mixed precision on
    one device (fp32 masters, bf16 compute copies) is."""
    from stepfx.testing.equivalence import mixed_precision_reference

    cfg = gpt_config("tiny", n_layers=max(2, world), n_heads=4 if 4 % world == 0 else world, dropout=0.0)
    g = torch.Generator().manual_seed(7)
    micro = 4
    batches = [torch.randint(0, cfg.vocab_size, (2 * micro, cfg.seq_len + 1), generator=g).to(device) for _ in range(4)]
    rows = []
    # with 4+ ranks also PP 2 x DP at ZeRO-3 (each stage's parameters partitioned over its data-parallel
    # ranks) and 3D: PP 2 x TP 2 x DP (ZeRO-1 where DP > 1); every rank gets the same batch, so the mean over
    # the data-parallel ranks is the single device's step
    modes = ("tp", "tp-sp", "pp") + (("pp-zero3", "3d") if world >= 4 and world % 4 == 0 else ())
    for mode in modes:
        for precision in ("fp32", "bf16"):
            config = {"gradient_clipping": 1.0, **({"bf16": {"enabled": True}} if precision == "bf16" else {})}
            if mode.startswith("tp"):
                config["tensor_parallel"] = {"autotp_size": world}
                if mode == "tp-sp":
                    config["stepfx"] = {"sequence_parallel": True}
            else:
                stages = world if mode == "pp" else 2
                config.update(pipeline={"stages": stages}, gradient_accumulation_steps=micro,
                              train_micro_batch_size_per_gpu=2)
                config["stepfx"] = {"pipeline": {"schedule": "1f1b"}}
                if mode == "pp-zero3":
                    config["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
                elif mode == "3d":
                    config["tensor_parallel"] = {"autotp_size": 2}
                    config["zero_optimization"] = {"stage": 1 if world > 4 else 0}
            torch.manual_seed(0)
            model = GPT(cfg).to(device)
            opt = _sgd(model)
            step = stepfx.parallelize(config)(stepfx_step)
            losses = [float(step(model, opt, b)) for b in batches]
            ours = {k: v.float().cpu() for k, v in step.model_state_dict().items()}
            row = {"check": f"{mode}-{precision}", "losses": losses}
            if rank == 0:
                def reference(fn):
                    torch.manual_seed(0)
                    ref = GPT(cfg).to(device)
                    ref_opt = _sgd(ref)
                    ref_losses = [float(fn(ref, ref_opt, b)) for b in batches]
                    return ref_losses, {k: v.float().cpu() for k, v in ref.state_dict().items()}

                def worst(a, b):
                    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)

                ref_losses, fp32 = reference(_reference_step)
                if precision == "fp32":
                    row.update(reference_losses=ref_losses, max_rel_param_diff=worst(ours, fp32))
                    row["ok"] = row["max_rel_param_diff"] <= 1e-5
                else:  # bf16 is judged by its distance from fp32, against the one-device bf16 step's
                    bf16_losses, bf16 = reference(mixed_precision_reference(_reference_step, torch.bfloat16))
                    ours_err, ref_err = worst(ours, fp32), worst(bf16, fp32)
                    row.update(reference_losses=bf16_losses, max_rel_param_diff_to_fp32=ours_err,
                               one_device_bf16_diff_to_fp32=ref_err, ok=ours_err <= 2 * ref_err + 1e-6)
            rows.append(row)
            del step, model, opt
            gc.collect()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("tp", "pp", "check"), default="tp")
    ap.add_argument("--size", default="1.3B")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="rows per step (tp) or per micro-batch (pp)")
    ap.add_argument("--micro", type=int, default=8, help="micro-batches a step (pp)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--systems", default=None)
    ap.add_argument("--codegen", choices=("default", "on", "off"), default="default")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    small = args.size in ("tiny", "small")
    args.batch = args.batch or (1 if args.mode == "pp" else 4)
    cfg = gpt_config(args.size, **({} if small and args.seq is None else {"seq_len": args.seq or 2048}))
    args.seq = cfg.seq_len
    device = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "world": world,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "mode": args.mode,
            "size": args.size, "seq": args.seq, "batch": args.batch, "micro": args.micro,
            "command": f"torchrun --nproc_per_node {world} benchmarks/multi_gpu.py " + " ".join(sys.argv[1:])}

    def emit(row):
        if rank == 0:
            row = {**meta, **row}
            print(json.dumps(row), flush=True)
            if args.out:
                with open(os.path.join(args.out, "multi_gpu.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")

    if args.mode == "check":
        for row in check(args, device, rank, world):
            emit(row)
        dist.destroy_process_group()
        return
    for kind in (args.systems or SYSTEMS[args.mode]).split(","):
        failed = 0.0
        try:
            row = measure(kind, cfg, args, device, rank, world)
        except Unavailable as exc:
            row = {"system": kind, "unavailable": str(exc)}
        except Exception as exc:  # one system's failure is reported; the others still run
            row, failed = {"system": kind, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}, 1.0
            gc.collect()
        flag = torch.tensor([failed], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and "error" not in row:
            row = {"system": kind, "error": "failed on another rank"}
        if "peak_alloc_gib" in row:
            peak = torch.tensor([row["peak_alloc_gib"]], device=device, dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            row["peak_alloc_gib"] = round(float(peak.item()), 2)
        dist.barrier()
        emit(row)
    dist.destroy_process_group()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()

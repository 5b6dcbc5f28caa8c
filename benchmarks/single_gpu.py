"""The standard GPT step on one GPU: stepfx (bf16, codegen off and on)
against eager PyTorch and torch.compile, in one run.

    python3 benchmarks/single_gpu.py --out $OUT            # the 1.3B workload of BENCHMARKS.md

Workload (BENCHMARKS.md): pre-LN GPT, d_model 2048, 24 layers, 16 heads,
seq 2048, micro-batch 4, vocab 50304, tied embeddings, AdamW(lr 3e-4,
betas 0.9/0.95, wd 0.1), gradient clipping 1.0, random tokens, bf16
compute with fp32 master weights. Peers:

- ``eager``: autocast(bf16), ``clip_grad_norm_``, ``AdamW(fused=True)``;
- ``compile``: the same with every block ``torch.compile``d;
- ``stepfx``: ``{"bf16": {"enabled": true}, "gradient_clipping": 1.0}``,
  with ``stepfx.codegen`` false and true (the fused kernels).

Each run: warm-up steps (capture and compilation happen there, timed as
``warmup_s``), then timed steps between ``torch.cuda.synchronize`` calls;
peak memory is reset after warm-up. MFU = (6N + 12 L d seq) x tokens/s /
989e12 with N the matmul parameters (BENCHMARKS.md). JSON lines to
``$OUT/single_gpu.jsonl`` and a ratio table to stdout.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import functools
import gc
import gzip
import importlib
import json
import os
import re
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import stepfx  # noqa: E402
from stepfx.testing.models import GPT, gpt_config, lm_loss  # noqa: E402

PEAK_FLOPS = 989e12  # H200 dense bf16


def stepfx_step(model, optimizer, tokens):
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def eager_step(model, optimizer, tokens, mixed: bool = True):
    """One eager step: autocast(bf16) unless the model computes in bf16
    itself (``mixed=False``: FSDP2's bf16 parameters), clipping, update."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16) if mixed else contextlib.nullcontext():
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile(kind: str, one_step, args, trace: bool = False) -> dict:
    """Three steps (``one_step(i)``) under torch.profiler: the top kernels by
    device time to ``$OUT/profile_<system>.txt`` (and the Chrome trace,
    gzipped, with ``trace``); returned: device busy ms per step by kind of
    kernel (matmul, attention, collectives, stepfx's Triton kernels, other)
    and the step's wall time under the profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    steps = 3
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for i in range(steps):
            one_step(i)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    groups = {"matmul": 0.0, "attention": 0.0, "nccl": 0.0, "stepfx_triton": 0.0, "triton_other": 0.0, "other": 0.0}
    for e in events:
        name = e.name.lower()
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        if any(k in name for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")):
            groups["matmul"] += us
        elif any(k in name for k in ("flash", "fmha", "attention", "cudnn")):
            groups["attention"] += us
        elif "nccl" in name:
            groups["nccl"] += us
        elif any(k in name for k in ("_adam_kernel", "_adam_many_kernel", "_sgd_kernel", "_layer_norm", "_rms_norm",
                                     "_lce_", "_sum_squares", "_segment_sum", "_cast_pack", "_sum_partials")):
            groups["stepfx_triton"] += us
        elif name.startswith("triton"):
            groups["triton_other"] += us
        else:
            groups["other"] += us
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=70)
        with open(os.path.join(args.out, f"profile_{kind}.txt"), "w") as f:
            f.write(table)
        if trace:
            path = os.path.join(args.out, f"trace_{kind}.json")
            prof.export_chrome_trace(path)
            with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(path)
    out = {k: round(v / 1e3 / steps, 2) for k, v in groups.items()}
    out["device_busy_ms"] = round(sum(v for k, v in groups.items() if k != "nccl") / 1e3 / steps, 2)
    out["wall_ms"] = round(wall * 1e3 / steps, 2)
    return out


def failure_row(kind: str, exc: BaseException) -> dict:
    """A system that failed, as its result row (a peer's failure is a result): out of memory or the error's first line."""
    if isinstance(exc, torch.OutOfMemoryError):
        return {"system": kind, "error": f"out of memory: {str(exc).splitlines()[0][:200]}"}
    return {"system": kind, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}


def record_row(row: dict, out: str | None, name: str) -> None:
    """Print ``row`` as a JSON line and append it to ``$OUT/<name>`` when ``out`` is set."""
    print(json.dumps(row), flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, name), "a") as f:
            f.write(json.dumps(row) + "\n")


def timed(one_step, steps: int, device) -> tuple[dict, object]:
    """Run ``one_step(i)`` ``steps`` times; (times, the last result). Times:
    ``step_ms`` (wall, start to the device's end, over the steps),
    ``host_ms`` (the mean time the host spent in a call: near ``step_ms``
    means host-bound), and on CUDA each step's time on the device's clock
    (events between steps, no synchronization) as min / median / max and,
    in order, ``each_ms``, so a one-off compilation inside the timed steps
    shows as an outlier, and where in the run slow steps fall."""
    cuda = device.type == "cuda"
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if cuda else []
    host = 0.0
    sync(device)
    start = time.perf_counter()
    if cuda:
        events[0].record()
    for i in range(steps):
        t = time.perf_counter()
        out = one_step(i)
        host += time.perf_counter() - t
        if cuda:
            events[i + 1].record()
    sync(device)
    wall = time.perf_counter() - start
    times = {"step_ms": round(wall * 1e3 / steps, 2), "host_ms": round(host * 1e3 / steps, 2)}
    if cuda:
        each = sorted(events[i].elapsed_time(events[i + 1]) for i in range(steps))
        times.update(min_ms=round(each[0], 2), median_ms=round(each[len(each) // 2], 2), max_ms=round(each[-1], 2),
                     each_ms=[round(events[i].elapsed_time(events[i + 1]), 2) for i in range(steps)])
    return times, out


def _indexed_step(step, model, optimizer, batches, i: int):
    return step(model, optimizer, batches[i % len(batches)])


def run(kind: str, args) -> dict:
    torch.manual_seed(0)
    cfg = gpt_config(args.size, seq_len=args.seq)
    device = torch.device(args.device)
    if device.type == "cuda":  # peaks from here: the warm-up (and a CUDA-graph capture) counts
        torch.cuda.reset_peak_memory_stats()
    model = GPT(cfg).to(device)
    adamw = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if kind.startswith("stepfx"):
        optimizer = torch.optim.AdamW(model.parameters(), **adamw)
        base, _, off = kind.partition("-no:")  # stepfx-codegen-no:pass_a+pass_b disables those passes
        graphs = base.endswith("-graphs")  # stepfx-codegen-graphs: replayed as CUDA graphs
        base = base.removesuffix("-graphs")
        config = {"bf16": {"enabled": True}, "gradient_clipping": 1.0,
                  "stepfx": {"codegen": base == "stepfx-codegen", "disable": off.split("+") if off else [],
                             "cuda_graphs": graphs and device.type == "cuda"}}
        step = stepfx.parallelize(config)(stepfx_step)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), fused=device.type == "cuda", **adamw)
        if kind == "compile":
            for block in model.blocks:
                block.compile()
        step = eager_step
    g = torch.Generator(device="cpu").manual_seed(123)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device) for _ in range(4)]
    start = time.perf_counter()
    for i in range(args.warmup):
        loss = step(model, optimizer, batches[i % 4])
    sync(device)
    warmup_s = time.perf_counter() - start
    times, loss = timed(functools.partial(_indexed_step, step, model, optimizer, batches), args.steps, device)
    step_s = times["step_ms"] / 1e3
    tokens = args.batch * args.seq
    n = model.matmul_params()
    flops_per_token = 6 * n + 12 * cfg.n_layers * cfg.d_model * args.seq
    tps = tokens / step_s
    row = {
        "system": kind, "size": args.size, "step_ms": round(step_s * 1e3, 2), "tokens_per_s": round(tps),
        "mfu": round(flops_per_token * tps / PEAK_FLOPS, 4),
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if device.type == "cuda" else None,
        "warmup_s": round(warmup_s, 1), "final_loss": round(float(loss), 4), "timing": times,
    }
    if args.profile and device.type == "cuda":
        row["profile"] = profile(kind, functools.partial(_indexed_step, step, model, optimizer, batches), args,
                                 trace=kind in args.trace.split(","))
    if kind.startswith("stepfx"):
        row["captures"] = len(step.plans)
        row["replay"] = step.plan.executor.graphs_note
        row["carried"] = step.plan.executor.binding.carried_notes()  # how often the kept bf16 copies were packed again
        if kind.startswith("stepfx-codegen"):
            text = step.explain()
            section = text.split("codegen:", 1)[1].split("\n\n", 1)[0]
            row["codegen"] = [line.strip() for line in section.splitlines()]
            from stepfx.codegen import multi_tensor
            from stepfx.codegen.regions import REGIONS

            row["regions"] = {"compiled": sum(r.failed is None for r in REGIONS.values()),
                              "failed": [r.failed for r in REGIONS.values() if r.failed]}
            row["multi_tensor_fallback"] = multi_tensor.FALLBACK
    del step, model, optimizer, batches
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row



def apply_settings(text: str) -> None:
    """``--set MODULE.NAME=VALUE,...``: override stepfx.codegen module constants (launch geometries) for this
    process, before any step (the launchers read them at each call). A value is a Python literal (``1``,
    ``(128,64,8,4)``, ``True``, ``None``); items are separated by the commas before ``MODULE.NAME=``."""
    for item in filter(None, re.split(r",(?=[A-Za-z_][\w]*\.[A-Za-z_]\w*=)", text)):
        name, _, value = item.partition("=")
        module, _, const = name.rpartition(".")
        try:
            target = importlib.import_module(f"stepfx.codegen.{module}")
            getattr(target, const)
            setattr(target, const, ast.literal_eval(value))
        except (ImportError, AttributeError, ValueError, SyntaxError) as exc:
            raise SystemExit(f"--set {item!r}: expected stepfx.codegen MODULE.NAME=LITERAL of an existing constant ({exc})")

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1.3B")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--systems", default="eager,compile,stepfx,stepfx-codegen")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (tiny sizes)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--profile", action="store_true", help="also profile 3 steps of each system (after the timed ones)")
    ap.add_argument("--trace", default="", help="with --profile: systems whose Chrome trace is kept (gzipped)")
    ap.add_argument("--set", default="", metavar="MODULE.NAME=INT,...",
                    help="override stepfx.codegen module constants (launch geometries) for this run, e.g. the "
                         "fastest of a sweep: kernel_sweep.py --best")
    args = ap.parse_args()
    apply_settings(args.set)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    meta = {"date": datetime.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__,
            "command": f"python3 benchmarks/single_gpu.py --size {args.size} --systems {args.systems}"
                       + (f" --set {args.set}" if args.set else "")}
    rows = []
    for kind in args.systems.split(","):
        try:
            row = run(kind, args)
        except Exception as exc:
            row = {"system": kind, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
        rows.append({**meta, **row})
        print(json.dumps(rows[-1]), flush=True)
        if args.out:  # line by line: a run cut short keeps what it measured
            with open(os.path.join(args.out, "single_gpu.jsonl"), "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    by = {r["system"]: r for r in rows if "tokens_per_s" in r}
    for system in ("stepfx", "stepfx-codegen"):
        for peer in ("eager", "compile"):
            if system in by and peer in by:
                print(f"{system} / {peer}: tokens/s x{by[system]['tokens_per_s'] / by[peer]['tokens_per_s']:.3f}, "
                      f"peak alloc {by[system]['peak_alloc_gib']} vs {by[peer]['peak_alloc_gib']} GiB")


if __name__ == "__main__":
    main()

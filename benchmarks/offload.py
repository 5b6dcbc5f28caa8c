"""Optimizer offload on one GPU: stepfx's offload_optimizer against the same
step without offloading and DeepSpeed's ZeRO-Offload, peers in the same run.

    python3 benchmarks/offload.py --out $OUT                       # 1.3B, seq 2048, micro-batch 4
    python3 benchmarks/offload.py --gas 8 --systems stepfx-offload,deepspeed-offload

Workload as benchmarks/single_gpu.py (BENCHMARKS.md's GPT, bf16 with fp32
masters, AdamW lr 3e-4 betas (0.9, 0.95) wd 0.1, clipping 1.0). Each system
in its own process (a failure, out of memory or the host's OOM killer, is
recorded as such):

- ``stepfx``, ``stepfx-z3``: ZeRO-2 / ZeRO-3 on one rank, nothing offloaded (the baselines);
- ``stepfx-offload``: ZeRO-2 + ``offload_optimizer: {device: cpu, pin_memory: true}``;
- ``stepfx-offload-fused``: the same with ``stepfx.host_adam: "fused"``;
- ``stepfx-offload-z3``: the same at ZeRO-3;
- ``stepfx-offload-z3-devmasters``: ``stepfx-offload-z3`` with ``stepfx.host_master_weights: false`` (the fp32
  pieces on the device, as before 2026-12-05; by default they live on the host with bf16 copies on the device);
- ``stepfx-offload-z3-dpu``: ``stepfx-offload-z3`` with ``stepfx.delayed_parameter_update`` (ZeRO-Offload's
  one-step delayed update: the host update runs while the next step computes);
- ``stepfx-offload-z3-across``: ``stepfx-offload-z3`` with ``stepfx.host_update_across_steps`` (the update that
  waits for the norm finishes while the next step's forward runs, each bucket waited for where it is first read;
  exact). Timed with the last step's host update inside the timed steps;
- ``stepfx-offload-param``: ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on the host (pinned,
  the fused host Adam working on the host pieces in place; the pieces fetched ahead on a parameter stream);
- ``eager``: the plain step on the device (autocast bf16, ``clip_grad_norm_``, ``AdamW(fused=True)``), nothing
  offloaded: at 13B it does not fit, and the row says how it fails;
- ``deepspeed-offload``: DeepSpeed ZeRO-3 + the same offload block with its
  own CPU Adam (DeepSpeedCPUAdam, built on first use);
- ``deepspeed-offload-torch``: the same with torch's AdamW on the host
  (``zero_force_ds_cpu_optimizer: false``), the issue's earlier measurement;
- ``deepspeed-offload-param-torch``: the same with ``offload_param: {device: cpu, pin_memory: true}``
  (ZeRO-Infinity on the host).

Reported: tokens/s (micro-batches of ``--batch`` x ``--seq`` tokens;
``--gas`` micro-batches per optimizer step; ``--clip 0`` turns clipping off for every system, so the host
update needs no global answer and starts with its gradients), MFU, peak GPU memory allocated,
the process's peak host RSS, the step timing. JSON lines to
``$OUT/offload.jsonl``.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import stepfx  # noqa: E402
from benchmarks.single_gpu import PEAK_FLOPS, failure_row, record_row, stepfx_step, sync, timed  # noqa: E402
from stepfx.testing.models import GPT, gpt_config, lm_loss  # noqa: E402

SYSTEMS = ("eager,stepfx,stepfx-z3,stepfx-offload,stepfx-offload-fused,stepfx-offload-z3,stepfx-offload-z3-devmasters,"
           "stepfx-offload-z3-dpu,stepfx-offload-z3-across,stepfx-offload-param,deepspeed-offload,deepspeed-offload-torch,"
           "deepspeed-offload-param-torch")
ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)


def _stepfx(kind: str, model, args):
    params = kind.endswith("-param")
    stage = 3 if "-z3" in kind or params else 2
    extra = {"stepfx": {"host_adam": "fused"}} if kind.endswith("-fused") or params else {}
    if kind.endswith("-devmasters"):
        extra = {"stepfx": {"host_master_weights": False}}
    if kind.endswith("-dpu"):  # --dpu-exact-steps N: the delay begins after N exact steps
        extra = {"stepfx": {"delayed_parameter_update": args.dpu_exact_steps or True}}
    if kind.endswith("-across"):  # the host update that waits for the norm finishes in the next step's forward
        extra.setdefault("stepfx", {})["host_update_across_steps"] = True
    if args.recompute is not None:
        extra.setdefault("stepfx", {})["activation_memory_budget"] = args.recompute
    if args.speculation != "auto":  # off: each host update waits for the norm (a kept guess goes up into a new
        # tensor, so with the masters on the device it holds them twice: 48 GiB at 13B)
        extra.setdefault("stepfx", {})["host_update_speculation"] = args.speculation == "on"
    zero = {"stage": stage, "overlap_comm": True}
    if "offload" in kind:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.gas,
              "bf16": {"enabled": True}, "gradient_clipping": args.clip, "zero_optimization": zero, **extra}
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    step = stepfx.parallelize(config)(stepfx_step)
    return lambda tokens: step(model, optimizer, tokens), step


def _deepspeed(kind: str, model, args):
    import deepspeed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.gas,
        "bf16": {"enabled": True}, "gradient_clipping": args.clip,
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    }
    if "-param" in kind:
        ds_config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    if kind.endswith("-torch"):
        ds_config["zero_force_ds_cpu_optimizer"] = False
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    else:
        ds_config["optimizer"] = {"type": "AdamW", "params": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]),
                                                              "weight_decay": ADAMW["weight_decay"]}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    def run(tokens):
        loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss

    return run, None


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def _eager(kind: str, model, args):
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
    calls = [0]

    def run(tokens):
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        (loss / args.gas).backward()
        calls[0] += 1
        if calls[0] % args.gas == 0:
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss

    return run, None


def run(kind: str, args) -> dict:
    torch.manual_seed(0)
    device = torch.device(args.device)
    cfg = gpt_config(args.size, seq_len=args.seq, **({"n_layers": args.layers} if args.layers else {}))
    with device:  # made where it trains: a 13B model made on the host first would take 50 GB of it
        model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    make = _deepspeed if kind.startswith("deepspeed") else _eager if kind == "eager" else _stepfx
    one, step = make(kind, model, args)
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device) for _ in range(2)]
    rss_before = _rss_gib()  # the host memory the process holds before its first step (libraries, CUDA context)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    warm = []
    for i in range(args.warmup * args.gas):
        start = time.perf_counter()
        one(batches[i % 2])
        sync(device)
        warm.append(round(time.perf_counter() - start, 2))
    from stepfx.runtime import host_optimizer

    host_optimizer.STATS.update({k: type(v)() for k, v in host_optimizer.STATS.items()})
    if device.type == "cuda":  # the steady state's peak apart (the first call also holds what it converts)
        first_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    n = args.steps * args.gas
    settle = step._apply_delayed_update if step is not None else (lambda: None)
    settle()  # a host update a warm-up step left running (host_update_across_steps) is not the timed steps'
    # the last timed step's own is: the timed steps are each step's device work and host update, nothing left out
    times, loss = timed(lambda i: one(batches[i % 2]) if i < n - 1 else (one(batches[i % 2]), settle())[0], n, device)
    host = dict(host_optimizer.STATS)
    tps = args.batch * args.seq / (times["step_ms"] / 1e3)
    flops_per_token = 6 * model.matmul_params() + 12 * cfg.n_layers * cfg.d_model * args.seq
    row = {"system": kind, "size": args.size, "params": params, "batch": args.batch, "seq": args.seq, "gas": args.gas,
           "tokens_per_s": round(tps), "mfu": round(flops_per_token * tps / PEAK_FLOPS, 4), "first_call_s": warm[0],
           "peak_alloc_gib": round(max(first_peak, torch.cuda.max_memory_allocated()) / 2**30, 2)
           if device.type == "cuda" else None,
           "steady_peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
           "peak_host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
           "final_loss": round(float(loss.detach()), 4), "timing": times}
    if step is not None:
        row["offload"] = next((r.summary for r in step.plan.records if r.name == "offload_optimizer"), None)
        if host["jobs"]:  # the host worker's seconds per optimizer step
            row["host_update"] = {k: round(host[k] / args.steps, 3) for k in ("wait_down_s", "update_s", "wait_up_s")}
            row["host_update"].update(jobs_per_step=host["jobs"] / args.steps,
                                      elements_per_s=round(host["elements"] / max(host["update_s"], 1e-9)),
                                      speculated_per_step=host["speculated"] / args.steps,
                                      rolled_back_per_step=host["rolled_back"] / args.steps,
                                      backup_s=round(host["backup_s"] / args.steps, 3),
                                      copies_peak_gib=round(host["copies_peak"] / 2**30, 2))
        row["masters"] = next((r.summary for r in step.plan.records if r.name == "host_master_weights"), None)
        # the planner's prediction against what was measured: GPU peak (allocated), host bytes the step added
        from stepfx.graph.accounting import estimate_memory

        est = estimate_memory(step.plan.graph)
        row["predicted"] = {"gpu_peak_gib": round(est.peak / 2**30, 2),
                            "host_gib": round((est.host + est.host_transient) / 2**30, 2),
                            "host_measured_gib": round(row["peak_host_rss_gib"] - rss_before, 2)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1.3B")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=0)  # blocks instead of --size's (the largest trainable size)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--gas", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--systems", default=SYSTEMS)
    ap.add_argument("--clip", type=float, default=1.0)  # gradient_clipping for every system; 0: off
    ap.add_argument("--system-timeout", type=int, default=None)  # seconds a system may run before it is recorded as timed out
    ap.add_argument("--recompute", type=float, default=None)  # stepfx.activation_memory_budget for stepfx systems
    ap.add_argument("--speculation", choices=("auto", "on", "off"), default="auto")  # stepfx.host_update_speculation
    ap.add_argument("--dpu-exact-steps", type=int, default=0)  # stepfx-offload-z3-dpu: exact optimizer steps first
    ap.add_argument("--device", default="cuda")  # cpu: a smoke test of the script
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    systems = args.systems.split(",")
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "host_cpus": os.cpu_count(),
            "command": f"python3 benchmarks/offload.py --size {args.size} --seq {args.seq} --batch {args.batch} "
                       f"--gas {args.gas} --clip {args.clip} --systems {args.systems}"
                       + (f" --layers {args.layers}" if args.layers else "")
                       + (f" --recompute {args.recompute}" if args.recompute is not None else "")
                       + (f" --dpu-exact-steps {args.dpu_exact_steps}" if args.dpu_exact_steps else "")
                       + (f" --speculation {args.speculation}" if args.speculation != "auto" else "")}
    if len(systems) > 1:  # one process per system
        for kind in systems:
            cmd = [sys.executable, os.path.abspath(__file__), "--systems", kind, "--size", args.size,
                   "--layers", str(args.layers), "--seq",
                   str(args.seq), "--batch", str(args.batch), "--gas", str(args.gas), "--warmup", str(args.warmup),
                   "--steps", str(args.steps), "--device", args.device, "--clip", str(args.clip)] + (["--out", args.out] if args.out else []) \
                + (["--recompute", str(args.recompute)] if args.recompute is not None else []) \
                + ["--dpu-exact-steps", str(args.dpu_exact_steps), "--speculation", args.speculation]
            try:
                done = subprocess.run(cmd, check=False, timeout=args.system_timeout)
            except subprocess.TimeoutExpired:
                record_row({**meta, "system": kind, "error": f"timed out after {args.system_timeout} s"}, args.out,
                           "offload.jsonl")
                continue
            if done.returncode < 0 or done.returncode == 137:  # killed (the host's OOM killer): say so
                record_row({**meta, "system": kind, "error": f"killed (exit {done.returncode})"}, args.out, "offload.jsonl")
        return
    kind = systems[0]
    try:
        row = run(kind, args)
    except Exception as exc:  # a peer's failure is a result
        row = failure_row(kind, exc)
    gc.collect()
    record_row({**meta, **row}, args.out, "offload.jsonl")

if __name__ == "__main__":
    main()

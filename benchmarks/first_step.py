"""How long a job waits for its first step: cold (empty caches) against warm
(a second process on the same cache folder: the plan comes from stepfx's
plan cache, the kernels from inductor's and Triton's caches under it).

    python3 benchmarks/first_step.py --out $OUT                       # the 1.3B GPT, bf16 + codegen, on CUDA
    TRITON_INTERPRET=1 python3 benchmarks/first_step.py --device cpu --size tiny     # a smoke test
    python3 benchmarks/first_step.py --device cpu --size small --layers 12 --d-model 512 --codegen off

The workload is benchmarks/single_gpu.py's ``stepfx-codegen`` system (GPT,
AdamW, bf16 with fp32 masters, clipping 1.0). Each run is a fresh process:
``cold`` starts on an empty folder (TORCHINDUCTOR_CACHE_DIR and
TRITON_CACHE_DIR are removed from its environment, so both compilers' caches
start empty under it too), ``warm`` then reuses it. Each prints a JSON line
with its phases: ``import_s`` (torch and stepfx), ``model_s`` (building the
model on the device), ``first_call_s`` (the first step, to the device's
end), split into ``capture_s``/``passes_s`` (0 when loaded), ``cache_s``
(loading the plan, or writing it), ``first_run_s`` (the rest: binding,
compiling kernels and running), then ``second_call_s`` and
``to_first_step_s`` (process start to the end of the first step). Lines go
to stdout and ``$OUT/first_step.jsonl``.
"""
from __future__ import annotations

import time

_STARTED = time.perf_counter()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(args) -> dict:
    """One process's first and second step (``--child``)."""
    import torch

    sys.path.insert(0, ROOT)
    import stepfx
    from stepfx.testing.models import GPT, gpt_config, lm_loss

    imported = time.perf_counter()

    def train_step(model, optimizer, tokens):
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    overrides = {k: v for k, v in (("n_layers", args.layers), ("d_model", args.d_model)) if v is not None}
    cfg = gpt_config(args.size, seq_len=args.seq, **overrides)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    sync()
    built = time.perf_counter()
    codegen = args.codegen == "on"
    config = {"bf16": {"enabled": codegen}, "gradient_clipping": 1.0,
              "stepfx": {"codegen": codegen, "cache_dir": args.cache_dir}}
    step = stepfx.parallelize(config)(train_step)
    g = torch.Generator().manual_seed(123)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device) for _ in range(2)]
    start = time.perf_counter()
    step(model, optimizer, batches[0])
    sync()
    first = time.perf_counter() - start
    to_first = time.perf_counter() - _STARTED
    start = time.perf_counter()
    loss = step(model, optimizer, batches[1])
    sync()
    second = time.perf_counter() - start
    plan = step.plan
    skipped = plan.from_cache
    capture = 0.0 if skipped else plan.capture_seconds
    passes = 0.0 if skipped else plan.passes_seconds
    return {
        "run": args.child, "size": args.size, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "codegen": codegen, "from_cache": skipped, "ops": plan.graph.count_ops(),
        "import_s": round(imported - _STARTED, 2), "model_s": round(built - imported, 2),
        "first_call_s": round(first, 2), "capture_s": round(capture, 2), "passes_s": round(passes, 2),
        "cache_s": round(plan.cache_seconds, 2), "first_run_s": round(first - capture - passes - plan.cache_seconds, 2),
        "second_call_s": round(second, 2), "to_first_step_s": round(to_first, 2), "loss": round(float(loss), 4),
        "cache_note": plan.cache_note,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1.3B")
    ap.add_argument("--layers", type=int, default=None, help="override the size's number of blocks")
    ap.add_argument("--d-model", type=int, default=None, help="override the size's width")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the size's)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test (TRITON_INTERPRET=1 for codegen)")
    ap.add_argument("--codegen", choices=("on", "off"), default="on")
    ap.add_argument("--cache-dir", default=None, help="the plan cache folder (default: a new empty one)")
    ap.add_argument("--runs", default="cold,warm", help="processes to start in turn on the same folder")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.seq is None:
        from stepfx.testing.models import gpt_config  # noqa: PLC0415 (light: no torch import needed beyond it)

        args.seq = gpt_config(args.size).seq_len
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="stepfx-first-step-")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if args.device == "cpu" and args.codegen == "on":
        env.setdefault("TRITON_INTERPRET", "1")
    meta = {"date": datetime.date.today().isoformat(), "cache_dir": cache_dir,
            "command": "python3 benchmarks/first_step.py " + " ".join(sys.argv[1:])}
    argv = [a for a in sys.argv[1:]]
    rows = []
    for run in args.runs.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--cache-dir", cache_dir, "--seq", str(args.seq),
               "--child", run]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        sys.stderr.write(done.stderr)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            row = {"run": run, "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
        else:
            row = json.loads(lines[-1])
        rows.append({**meta, **row})
        print(json.dumps(rows[-1]), flush=True)
        if args.out:
            with open(os.path.join(args.out, "first_step.jsonl"), "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    by = {r["run"]: r for r in rows if "first_call_s" in r}
    if "cold" in by and "warm" in by:
        print(f"first call: cold {by['cold']['first_call_s']} s, warm {by['warm']['first_call_s']} s; process start to "
              f"first step: cold {by['cold']['to_first_step_s']} s, warm {by['warm']['to_first_step_s']} s")


if __name__ == "__main__":
    main()

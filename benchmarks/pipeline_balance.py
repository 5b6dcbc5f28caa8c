"""Pipeline stage balance on one GPU: partition_stages' cost model against
each stage's program timed alone.

    PYTHONPATH=. python3 benchmarks/pipeline_balance.py --out $OUT        # 1.3B, 4 stages, seq 2048
    PYTHONPATH=. python3 benchmarks/pipeline_balance.py --size tiny --device cpu --stages 2   # a smoke run

The workload of BENCHMARKS.md (GPT 1.3B, bf16 compute with fp32 masters,
clipping 1.0) captured on one micro-batch and cut into ``--stages`` stages
by ``partition_stages`` (method "best": forward + backward time by the cost model).
Each stage's forward and backward program runs alone on the GPU, in
pipeline order (F0..F{S-1}, then B{S-1}..B0) on one micro-batch, timed
with CUDA events over ``--reps`` runs after a warm-up.

Calibration: the device's bf16 matmul rate, copy bandwidth and the host's
time per op are measured here (an 8192^3 matmul, a 1 GiB copy, an fx chain
of 2,000 one-element adds) and the cost model (``op_cost``) is evaluated
again with them. Reported: per stage the predicted share of forward +
backward (assumed and calibrated rates) and the measured shares of forward and of
forward+backward, and the largest relative deviation of the measured
forward+backward share from the calibrated prediction (issue 20 asks for
10%). JSON lines to ``$OUT/pipeline_balance.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stepfx.capture import CaptureOptions, capture_step, collect_inputs  # noqa: E402
from stepfx.config import load_config  # noqa: E402
from stepfx.passes import PIPELINE, PassManager, PassOptions  # noqa: E402
from stepfx.passes.pipeline import partition_stages as ps  # noqa: E402
from stepfx.passes.pipeline.stage_programs import split_programs  # noqa: E402
from stepfx.runtime.binding import ModuleBinding, RankStore  # noqa: E402
from stepfx.testing.models import GPT, gpt_config, lm_loss  # noqa: E402


def lm_step(model, optimizer, idx):
    loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def device_rates(device: torch.device) -> ps.DeviceRates:
    """The cost model's rates measured on ``device``: bf16 matmul FLOP/s, copy bytes/s moved (read +
    write), and the host's time per op of an fx program run op by op (a chain of 2,000 adds on one
    element: nothing for the device to do)."""
    if device.type != "cuda":
        return ps.RATES
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    x = torch.empty(256 * 1024 * 1024, device=device, dtype=torch.float32)
    y = torch.empty_like(x)
    for _ in range(3):
        a @ b
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    flops = 10 * 2 * n ** 3 / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bandwidth = 10 * 2 * x.numel() * 4 / (time.perf_counter() - t)
    del a, b, x, y
    g = torch.fx.Graph()
    v = g.placeholder("x")
    for _ in range(2000):
        v = g.call_function(torch.ops.aten.add.Tensor, (v, 1))
    g.output(v)
    chain = torch.fx.GraphModule(torch.nn.Module(), g)
    one = torch.zeros(1, device=device)
    chain(one)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        chain(one)
    torch.cuda.synchronize()
    overhead = (time.perf_counter() - t) / (5 * 2000)
    return ps.DeviceRates(flops=flops, bandwidth=bandwidth, op_overhead=overhead)
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="1.3B")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    parser.add_argument("--codegen", choices=["on", "off"], default=None,
                        help="stepfx's kernels in the stage programs (default: on for CUDA, as stepfx)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    overrides = {"seq_len": args.seq} if args.size != "tiny" else {}
    model = GPT(gpt_config(args.size, **overrides)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    vocab = model.tok.weight.shape[0]
    seq = args.seq if args.size != "tiny" else 16
    idx = torch.randint(0, vocab, (args.batch, seq + 1), device=device)
    bf16 = device.type == "cuda"
    codegen = (args.codegen or ("on" if device.type == "cuda" else "off")) == "on"
    cfg = load_config({"gradient_clipping": 1.0, **({"bf16": {"enabled": True}} if bf16 else {}),
                       "stepfx": {"codegen": codegen}})
    options = CaptureOptions(compute_dtype=torch.bfloat16 if bf16 else None, cast_inputs=bf16)
    started = time.perf_counter()
    inputs = collect_inputs(model, opt, (idx,), {}, held={}, options=options)
    captured = capture_step(lm_step, model, opt, (idx,), {}, inputs=inputs, options=options)
    capture_s = time.perf_counter() - started
    records = PassManager(PIPELINE).run(captured, PassOptions(config=cfg, device_type=device.type,
                                                              extra={ps.STAGES_KEY: args.stages}))
    final = records[-1].graph
    plan = final.signature.extra[ps.PIPELINE_KEY]
    programs = split_programs(final)
    rates = device_rates(device)
    fwd_pred, bwd_pred = ps.stage_costs(final.gm.graph, rates)
    calibrated = [f + b for f, b in zip(fwd_pred, bwd_pred)]

    graph_inputs = ModuleBinding(final.signature, model, opt, RankStore()).inputs([idx])
    order = [("F", s) for s in range(args.stages)] + [("B", s) for s in reversed(range(args.stages))]
    seconds = {key: [] for key in order}
    for rep in range(args.reps + 2):
        store: dict = {}
        for key in order:
            prog = programs.programs.get(key)
            if prog is None:
                continue
            call_args = [graph_inputs[i] if src == "graph" else store[i] for src, i in prog.inputs]
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                out = prog.gm(*call_args)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if rep >= 2:
                seconds[key].append(time.perf_counter() - t)
            store.update(zip(prog.outputs, out))
        del store
    med = {k: sorted(v)[len(v) // 2] if v else 0.0 for k, v in seconds.items()}
    fwd = [med[("F", s)] for s in range(args.stages)]
    both = [med[("F", s)] + med[("B", s)] for s in range(args.stages)]

    def shares(xs):
        total = sum(xs) or 1.0
        return [x / total for x in xs]

    rows = []
    for s in range(args.stages):
        rows.append({"stage": s, "predicted_share_assumed": shares(plan.costs)[s],
                     "predicted_share_calibrated": shares(calibrated)[s],
                     "predicted_forward_ms": 1e3 * fwd_pred[s], "predicted_backward_ms": 1e3 * bwd_pred[s],
                     "measured_forward_share": shares(fwd)[s],
                     "measured_fwd_bwd_share": shares(both)[s], "forward_ms": 1e3 * fwd[s],
                     "backward_ms": 1e3 * med[("B", s)], "params": plan.params[s]})
    deviation = max(abs(r["measured_fwd_bwd_share"] - r["predicted_share_calibrated"]) / r["predicted_share_calibrated"]
                    for r in rows)
    result = {"bench": "pipeline_balance", "size": args.size, "seq": seq, "batch": args.batch, "stages": args.stages,
              "codegen": codegen,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "capture_s": capture_s, "matmul_tflops": rates.flops / 1e12, "copy_gbps": rates.bandwidth / 1e9,
              "op_overhead_us": rates.op_overhead * 1e6,
              "cuts": list(plan.cuts), "crossing_bytes": list(plan.crossing_bytes), "rows": rows,
              "max_relative_deviation": deviation}
    print(f"codegen {'on' if codegen else 'off'}")
    print("\n".join(plan.describe()))
    print(f"device rates: {rates.flops / 1e12:.0f} TFLOP/s bf16 matmul, {rates.bandwidth / 1e9:.0f} GB/s copy, "
          f"{rates.op_overhead * 1e6:.1f} us of host time per op")
    print(f"{'stage':>5} {'pred(assumed)':>14} {'pred(calib)':>12} {'meas fwd':>9} {'meas f+b':>9} {'fwd ms':>8} {'bwd ms':>8}")
    for r in rows:
        print(f"{r['stage']:>5} {r['predicted_share_assumed']:>14.3f} {r['predicted_share_calibrated']:>12.3f} "
              f"{r['measured_forward_share']:>9.3f} {r['measured_fwd_bwd_share']:>9.3f} {r['forward_ms']:>8.2f} "
              f"{r['backward_ms']:>8.2f}")
    print(f"largest deviation of the measured forward+backward share from the calibrated prediction: "
          f"{100 * deviation:.1f}%")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "pipeline_balance.jsonl"), "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()

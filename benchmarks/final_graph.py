"""The final per-rank graph of the standard GPT step (BENCHMARKS.md's
workload at fewer layers), as stepfx would run it on this machine's device,
and the count of each op in it: what the fusion passes left.

    python3 benchmarks/final_graph.py --layers 2 --out $OUT      # on the GPU machine: CUDA ops (cuDNN attention)

Writes ``final_graph_<device>_<layers>l.py`` (the graph's code) and prints
the op counts and the pass records. Nothing runs but capture and passes
(on CUDA the model and batch are real tensors on the device; on CPU meta).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from single_gpu import stepfx_step  # noqa: E402  (the step single_gpu.py times)

from stepfx.capture import CaptureOptions, capture_step  # noqa: E402
from stepfx.config import load_config  # noqa: E402
from stepfx.passes import PIPELINE, PassManager, PassOptions  # noqa: E402
from stepfx.testing.models import GPT, gpt_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "meta"
    cfg = gpt_config("1.3B", n_layers=args.layers, seq_len=2048)
    with torch.device(device):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    for p in model.parameters():  # steady state: the optimizer holds its state (as after step 1)
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    tokens = torch.zeros(4, 2049, dtype=torch.long, device=device)
    config = load_config({"bf16": {"enabled": True}, "gradient_clipping": 1.0, "stepfx": {"codegen": True}})
    graph = capture_step(stepfx_step, model, opt, (tokens,), {}, options=CaptureOptions(compute_dtype=torch.bfloat16))
    records = PassManager(PIPELINE).run(graph, PassOptions(config=config, device_type="cuda"))
    for record in records:
        print(record.provenance())
    final = records[-1].graph
    counts = collections.Counter(getattr(n.target, "__name__", str(n.target))
                                 for n in final.gm.graph.nodes if n.op == "call_function")
    for name, count in counts.most_common():
        print(f"{count:6d}  {name}")
    path = os.path.join(args.out, f"final_graph_{device}_{args.layers}l.py")
    with open(path, "w") as f:
        f.write(final.gm.code)
    print("wrote", path)


if __name__ == "__main__":
    main()

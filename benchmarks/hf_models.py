"""Hugging Face decoders on one GPU: eager, torch.compile and stepfx
(codegen) in one run, per model family, at published ~1B shapes with
random weights.

    python3 benchmarks/hf_models.py --out $OUT                         # llama, qwen2, gpt_neox
    python3 benchmarks/hf_models.py --families llama --profile --out $OUT

Workload (issue 24): micro-batch 4, seq 2048, random tokens as inputs and
labels (the model's own causal-LM loss: shifted labels, ignore_index
-100, fp32 logits), SDPA attention, AdamW(lr 3e-4, betas 0.9/0.95, wd
0.1), gradient clipping 1.0, bf16 compute with fp32 master weights.

- ``eager``: autocast(bf16), ``clip_grad_norm_``, ``AdamW(fused=True)``;
- ``compile``: the same with the whole model ``torch.compile``d
  (``model.compile()``);
- ``stepfx``: ``{"bf16": {"enabled": true}, "gradient_clipping": 1.0,
  "stepfx": {"codegen": true}}`` around the plain step; ``stepfx-graphs``
  the same replayed as CUDA graphs (``"cuda_graphs": true``).

Each system: ``--warmup`` steps (the first call timed alone as
``first_call_s``), then ``--steps`` timed steps; peak memory counted from
model creation. MFU as BENCHMARKS.md: (6N + 12 L d seq) tokens/s / 989e12,
N the parameters of the linear layers (a tied head counted once). JSON
lines to ``$OUT/hf_models.jsonl``; ratios to stdout.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import stepfx  # noqa: E402
from single_gpu import PEAK_FLOPS, profile, sync, timed  # noqa: E402

# Published shapes (config.json of each checkpoint), random init; dropout off so every system trains the same model.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(  # meta-llama/Llama-3.2-1B (without its rope_scaling)
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=True, head_dim=64)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(  # Qwen/Qwen2.5-1.5B
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(  # EleutherAI/pythia-1b
        vocab_size=50304, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=8,
        rotary_pct=0.25, max_position_embeddings=4096, use_parallel_residual=True, tie_word_embeddings=False,
        hidden_dropout=0.0, attention_dropout=0.0)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(  # facebook/opt-1.3b
        vocab_size=50272, hidden_size=2048, ffn_dim=8192, num_hidden_layers=24, num_attention_heads=32,
        max_position_embeddings=2048 + 2, word_embed_proj_dim=2048, dropout=0.0, attention_dropout=0.0,
        tie_word_embeddings=True)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(  # google/gemma-2b, 4 layers fewer than published (fits 1B-ish)
        vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=14, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh")),
}


def build(family: str, seq: int):
    import transformers

    config_cls, model_cls, shape = FAMILIES[family]
    config = getattr(transformers, config_cls)(**shape, attn_implementation="sdpa")
    config.use_cache = False
    model = getattr(transformers, model_cls)(config)
    return model, config


def matmul_params(model) -> int:
    """Parameters of the linear layers, each tensor counted once (a tied head is the embedding: counted once)."""
    seen, n = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            n += module.weight.numel()
    return n


def plain_step(model, optimizer, input_ids):
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def eager_step(model, optimizer, input_ids):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def run(family: str, kind: str, args) -> dict:
    device = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model, config = build(family, args.seq)
    model = model.to(device)
    adamw = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if kind.startswith("stepfx"):  # stepfx-graphs: the step replayed as CUDA graphs
        optimizer = torch.optim.AdamW(model.parameters(), **adamw)
        step = stepfx.parallelize({"bf16": {"enabled": True}, "gradient_clipping": 1.0,
                                   "stepfx": {"codegen": True, "cuda_graphs": kind == "stepfx-graphs",
                                              "disable": args.disable.split("+") if args.disable else []}})(plain_step)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), fused=True, **adamw)
        if kind == "compile":
            model.compile()
        step = eager_step
    g = torch.Generator(device="cpu").manual_seed(123)
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g).to(device) for _ in range(4)]
    start = time.perf_counter()
    loss = step(model, optimizer, batches[0])
    sync(device)
    first_s = time.perf_counter() - start
    for i in range(1, args.warmup):
        loss = step(model, optimizer, batches[i % 4])
    sync(device)
    warmup_s = time.perf_counter() - start
    one = functools.partial(lambda s, m, o, b, i: s(m, o, b[i % len(b)]), step, model, optimizer, batches)
    times, loss = timed(one, args.steps, device)
    tps = args.batch * args.seq / (times["step_ms"] / 1e3)
    n = matmul_params(model)
    flops_per_token = 6 * n + 12 * config.num_hidden_layers * config.hidden_size * args.seq
    row = {"family": family, "system": kind, "params": sum(p.numel() for p in model.parameters()), "matmul_params": n,
           "step_ms": times["step_ms"], "tokens_per_s": round(tps), "mfu": round(flops_per_token * tps / PEAK_FLOPS, 4),
           "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
           "first_call_s": round(first_s, 1), "warmup_s": round(warmup_s, 1), "final_loss": round(float(loss), 4),
           "timing": times}
    if args.profile:
        row["profile"] = profile(f"{family}_{kind}", one, args, trace=f"{family}_{kind}" in args.trace.split(","))
    if kind.startswith("stepfx"):
        row["captures"] = len(step.plans)
        text = step.explain()
        section = text.split("codegen:", 1)[1].split("\n\n", 1)[0] if "codegen:" in text else ""
        row["codegen"] = [line.strip() for line in section.splitlines()]
        if args.out:
            with open(os.path.join(args.out, f"explain_{family}_{kind}.txt"), "w") as f:
                f.write(text)
    del step, model, optimizer, batches
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="llama,qwen2,gpt_neox")
    ap.add_argument("--systems", default="eager,compile,stepfx")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--disable", default="", help="stepfx passes to turn off, a+b")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--trace", default="", help="with --profile: family_system names whose Chrome trace is kept")
    args = ap.parse_args()
    import transformers

    meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "command": "python3 benchmarks/hf_models.py " + " ".join(sys.argv[1:])}
    rows = []
    for family in args.families.split(","):
        for kind in args.systems.split(","):
            try:
                row = run(family, kind, args)
            except Exception as exc:
                import traceback

                traceback.print_exc()
                row = {"family": family, "system": kind, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
                gc.collect()
                torch.cuda.empty_cache()
            rows.append({**meta, **row})
            print(json.dumps(rows[-1]), flush=True)
            if args.out:
                with open(os.path.join(args.out, "hf_models.jsonl"), "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
    for family in args.families.split(","):
        by = {r["system"]: r for r in rows if r["family"] == family and "tokens_per_s" in r}
        for peer in ("eager", "compile"):
            if "stepfx" in by and peer in by:
                s, p = by["stepfx"], by[peer]
                print(f"{family}: stepfx / {peer}: tokens/s x{s['tokens_per_s'] / p['tokens_per_s']:.3f}, peak alloc "
                      f"{s['peak_alloc_gib']} vs {p['peak_alloc_gib']} GiB, first call {s['first_call_s']} vs {p['first_call_s']} s")


if __name__ == "__main__":
    main()

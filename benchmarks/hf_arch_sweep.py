"""A new user's sweep over Hugging Face models the tests do not build.

Tiny configs from ``AutoConfig.for_model``, fp32 AdamW, 4 right-padded
batches of a new length each (attention masks, labels -100 on the padding),
one process; stepfx against eager. Causal LMs by default; ``--task masked-lm``
or ``classification`` for encoders::

    STEPFX_CACHE_DIR=off PYTHONPATH=. python3 benchmarks/hf_arch_sweep.py qwen3 gemma3_text phimoe:router_jitter_noise=0.0

``type:key=value,...`` overrides config entries (random routers and dropout
off: stepfx draws its own random numbers, never eager's). Prints, per model,
the largest relative loss difference, the largest parameter difference
relative to its tensor's largest value, the number of plans, and OK where
both are 0 (bitwise). A config the model itself rejects fails in eager too:
the script says which side failed. Runs on the CPU.

``--world N --zero STAGE`` runs each model data-parallel on N local ranks
(gloo) with that ZeRO stage, each rank with its own batches (other lengths
on each rank, as a padding collator gives them), against the
single-process data-parallel reference
(``stepfx.testing.assert_data_parallel_equivalent``), within 1e-5
relative per tensor; ``--bf16`` adds ``bf16.enabled`` against the eager
mixed-precision reference (``mixed_precision_reference``: bf16 copies of
the fp32 parameters, fp32 gradients and update, as DeepSpeed's bf16)::

    STEPFX_CACHE_DIR=off PYTHONPATH=. python3 benchmarks/hf_arch_sweep.py --world 2 --zero 3 qwen3 mixtral
"""
from __future__ import annotations

import argparse
import ast
import copy
import functools
import logging
import os
import sys
import traceback
import warnings

# this directory holds a kernels.py, which would shadow the `kernels` package transformers imports
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
import transformers  # noqa: E402

import stepfx  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, head_dim=8, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
DROPOUTS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout",
            "hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout", "classifier_dropout_prob",
            "seq_classif_dropout")


AUTO_CLASSES = {"causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
                "classification": "AutoModelForSequenceClassification"}


def batches(task: str = "causal-lm", n: int = 4, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(6, 14, (), generator=g))
        ids = torch.randint(3, 64, (2, length), generator=g)
        mask = torch.ones(2, length, dtype=torch.long)
        mask[1, length - 3:] = 0
        labels = (torch.randint(0, 2, (2,), generator=g) if task == "classification"
                  else ids.masked_fill(mask == 0, -100))
        out.append({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "labels": labels})
    return out


def step(model, optimizer, batch):
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def build(model_type: str, overrides: dict, task: str) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **overrides})
    for key in DROPOUTS:
        if hasattr(config, key) and key not in overrides:
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    return getattr(transformers, AUTO_CLASSES[task]).from_config(config).train()


def compare(model_type: str, overrides: dict, task: str) -> tuple[float, float, int]:
    model = build(model_type, overrides, task)
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference))
    compiled = stepfx.parallelize({"gradient_clipping": 0})(step)
    worst = 0.0
    for batch in batches(task):
        try:
            expected = step(reference, ref_opt, batch)
        except Exception as exc:
            raise RuntimeError(f"eager fails too ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from exc
        got = compiled(model, opt, batch)
        worst = max(worst, abs(got.item() - expected.item()) / max(abs(expected.item()), 1e-12))
    params = max(((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item()
                 for p, q in zip(model.parameters(), reference.parameters()))
    return worst, params, len(compiled.plans)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def step_bf16_reference(model, optimizer, batch):
    from stepfx.testing.equivalence import mixed_precision_reference

    return mixed_precision_reference(step, torch.bfloat16)(model, optimizer, batch)


def compare_data_parallel(pool, model_type: str, overrides: dict, task: str, zero: int, bf16: bool):
    """The model on the pool's ranks (ZeRO ``zero``, each rank its own batches) against the single-process
    data-parallel reference. Returns (largest relative output difference, largest relative state difference,
    bitwise)."""
    from stepfx.testing.equivalence import assert_data_parallel_equivalent

    world = pool.world_size
    per_rank = [[(b,) for b in batches(task, seed=r)] for r in range(world)]
    config = {"gradient_clipping": 1.0, "zero_optimization": {"stage": zero}}
    if bf16:
        config["bf16"] = {"enabled": True}
    report = assert_data_parallel_equivalent(pool, step, functools.partial(build, model_type, overrides, task), adamw,
                                             per_rank, config=config, rtol=1e-5, atol=0.0, clip_norm=1.0,
                                             timeout=600, normwise=True,
                                             reference_fn=step_bf16_reference if bf16 else None)
    return max(report.output_rel, default=0.0), max(report.state_rel, default=0.0), report.bitwise


def parse(spec: str) -> tuple[str, dict]:
    model_type, _, rest = spec.partition(":")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        overrides[key] = ast.literal_eval(value)
    return model_type, overrides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="model types (AutoConfig), each optionally type:key=value,...")
    ap.add_argument("--task", choices=sorted(AUTO_CLASSES), default="causal-lm",
                    help="the head: causal LM (labels the inputs), masked LM (the same labels), or sequence "
                         "classification (2 classes)")
    ap.add_argument("--world", type=int, default=1, help="data-parallel ranks (gloo, local processes)")
    ap.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage with --world > 1")
    ap.add_argument("--bf16", action="store_true", help="bf16.enabled, against the mixed-precision reference")
    args = ap.parse_args()
    logging.getLogger("stepfx").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    if args.world > 1:
        from stepfx.testing.ranks import RankPool

        with RankPool(args.world) as pool:
            for spec in args.models:
                model_type, overrides = parse(spec)
                try:
                    out, state, bitwise = compare_data_parallel(pool, model_type, overrides, args.task, args.zero,
                                                                args.bf16)
                except Exception as exc:
                    print(f"{model_type:22s} FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
                    continue
                print(f"{model_type:22s} outputs {out:.1e} state {state:.1e} {'OK' if bitwise else 'CLOSE'}",
                      flush=True)
        return
    for spec in args.models:
        model_type, overrides = parse(spec)
        try:
            loss, params, plans = compare(model_type, overrides, args.task)
        except Exception as exc:
            print(f"{model_type:22s} FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
            traceback.print_exc(limit=-3)
            continue
        verdict = "OK" if loss == 0 and params == 0 else ("CLOSE" if loss < 1e-5 else "DIFF")
        print(f"{model_type:22s} loss {loss:.1e} params {params:.1e} plans {plans} {verdict}", flush=True)


if __name__ == "__main__":
    main()

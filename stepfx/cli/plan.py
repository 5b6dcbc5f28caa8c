"""``stepfx plan MODULE:FACTORY CONFIG --world-size N --batch 4x2049``:
per-rank memory and communication of a step, predicted on the meta device
(no GPU, no process group; stepfx/planning.py)."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from .check import positive_int
from .status import EXIT_INVALID, EXIT_OK, EXIT_USAGE

__all__ = ["plan_arguments", "run_plan"]

_STEPS = {"causal-lm": "stepfx.planning:causal_lm_step", "next-token": "stepfx.planning:next_token_step"}


def _dotted(text: str):
    """``module:attribute`` (or ``path/to/file.py:attribute``) imported."""
    module, sep, attr = text.partition(":")
    if not sep or not module or not attr:
        raise argparse.ArgumentTypeError(f"expected MODULE:NAME, got {text!r}")
    if module.endswith(".py"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(module)))
        module = os.path.basename(module)[:-3]
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise argparse.ArgumentTypeError(f"cannot import {module!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise argparse.ArgumentTypeError(f"{module!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def _batch(text: str):
    """``4x2049`` or ``4x2049:int64`` / ``8x3x224x224:float32``: a meta tensor."""
    import torch

    shape, _, dtype = text.partition(":")
    try:
        sizes = [int(s) for s in shape.lower().split("x")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shape like 4x2049[:int64], got {text!r}") from None
    dt = getattr(torch, dtype or "int64", None)
    if not isinstance(dt, torch.dtype):
        raise argparse.ArgumentTypeError(f"{dtype!r} is not a torch dtype")
    return torch.empty(sizes, dtype=dt, device="meta")


def plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("factory", help="MODULE:FUNCTION returning the model (called under the meta device)")
    parser.add_argument("config", help="the DeepSpeed JSON config")
    parser.add_argument("--world-size", type=positive_int, required=True, metavar="N")
    parser.add_argument("--rank", type=int, default=0, help="the rank to predict (default 0)")
    parser.add_argument("--batch", action="append", required=True, metavar="SHAPE[:DTYPE]",
                        help="a positional batch tensor of the step, e.g. 4x2049 (int64) or 8x3x224x224:float32; repeat for more")
    parser.add_argument("--step", default=None, metavar="MODULE:FUNCTION|causal-lm|next-token",
                        help="the training step (default: causal-lm for Hugging Face models, else next-token)")
    parser.add_argument("--device", default="cuda", help="the device type to plan for (default cuda)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run_plan(args: argparse.Namespace) -> int:
    from ..planning import predict

    try:
        factory = _dotted(args.factory)
        batch = [_batch(b) for b in args.batch]
        step_name = args.step
        if step_name is None:
            step_name = "causal-lm" if "transformers" in getattr(factory, "__module__", "") or _is_hf(factory) else "next-token"
        step = _dotted(_STEPS.get(step_name, step_name))
    except argparse.ArgumentTypeError as exc:
        print(f"stepfx plan: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not os.path.isfile(args.config):
        print(f"stepfx plan: {args.config}: no such file", file=sys.stderr)
        return EXIT_USAGE
    from ..config import ConfigError
    from ..errors import StepfxError

    try:
        prediction = predict(step, args.config, factory, *batch, world_size=args.world_size, rank=args.rank,
                             device=args.device)
    except (ConfigError, StepfxError, ValueError) as exc:
        print(f"stepfx plan: {exc}", file=sys.stderr)
        return EXIT_INVALID
    print(json.dumps(prediction.to_json(), indent=1) if args.json else prediction)
    return EXIT_OK


def _is_hf(factory) -> bool:
    """Whether the factory's model is a Hugging Face one (its module is transformers')."""
    module = getattr(factory, "__module__", "") or ""
    return module.startswith("transformers")

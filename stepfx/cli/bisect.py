"""``stepfx bisect MODULE:FACTORY CONFIG --batch 4x65``: which pass makes the
step compute something else than the captured one (``report/bisect.py``).

The model comes from the factory, the optimizer from ``--optimizer``
(MODULE:FUNCTION taking the model; default AdamW, lr 1e-4), the batch from
``--batch`` shapes (integer tensors: token ids below the model's smallest
embedding table; floating ones: standard normal; each rank its own) or from
``--batch-file`` (a ``torch.save``d tensor or tuple of tensors, loaded with
``weights_only``). Under torchrun every rank runs it (data parallelism: each
rank's batch, the data-parallel reference); rank 0 prints. Exit status 0
when no pass departs, 1 when one does (named with its node and source
line), 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import os
import sys

from .plan import _STEPS, _batch, _dotted, _is_hf
from .status import EXIT_INVALID, EXIT_OK, EXIT_USAGE

__all__ = ["bisect_arguments", "run_bisect"]


def bisect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("factory", help="MODULE:FUNCTION returning the model")
    parser.add_argument("config", help="the DeepSpeed JSON config")
    parser.add_argument("--batch", action="append", metavar="SHAPE[:DTYPE]",
                        help="a positional batch tensor, e.g. 4x65 (int64) or 8x3x32x32:float32; repeat for more")
    parser.add_argument("--batch-file", metavar="PATH", help="the batch as a torch.save'd tensor or tuple (weights only)")
    parser.add_argument("--step", default=None, metavar="MODULE:FUNCTION|causal-lm|next-token",
                        help="the training step (default: causal-lm for Hugging Face models, else next-token)")
    parser.add_argument("--optimizer", default=None, metavar="MODULE:FUNCTION",
                        help="builds the optimizer from the model (default: AdamW, lr 1e-4)")
    parser.add_argument("--device", default=None, help="where the model runs (default: cuda when available)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rtol", type=float, default=None, help="normwise (default: by the config's precision)")
    parser.add_argument("--atol", type=float, default=None)


def _real_batch(shapes: list, factory, device, seed: int, rank: int) -> tuple:
    """Tensors of the given shapes: token ids below the smallest embedding table, or normal values."""
    import torch

    with torch.device("meta"):
        probe = factory()
    vocab = min((m.num_embeddings for m in probe.modules() if isinstance(m, torch.nn.Embedding)), default=2)
    g = torch.Generator().manual_seed(seed + 1000 * (rank + 1))
    out = []
    for meta in shapes:
        if meta.dtype.is_floating_point:
            out.append(torch.randn(meta.shape, generator=g, dtype=meta.dtype).to(device))
        else:
            out.append(torch.randint(0, vocab, meta.shape, generator=g, dtype=meta.dtype).to(device))
    return tuple(out)


def run_bisect(args: argparse.Namespace) -> int:
    import torch

    from ..config import ConfigError, load_config
    from ..errors import StepfxError
    from ..report.bisect import bisect_divergence
    from ..runtime.distributed import data_parallel

    try:
        factory = _dotted(args.factory)
        step_name = args.step or ("causal-lm" if _is_hf(factory) else "next-token")
        step_fn = _dotted(_STEPS.get(step_name, step_name))
        make_optimizer = _dotted(args.optimizer) if args.optimizer else None
        shapes = [_batch(b) for b in args.batch or ()]
    except argparse.ArgumentTypeError as exc:
        print(f"stepfx bisect: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if bool(shapes) == bool(args.batch_file):
        print("stepfx bisect: give the batch as --batch shapes or as --batch-file, one of them", file=sys.stderr)
        return EXIT_USAGE
    if not os.path.isfile(args.config):
        print(f"stepfx bisect: {args.config}: no such file", file=sys.stderr)
        return EXIT_USAGE
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        config = load_config(args.config)
        dp = data_parallel(device.type)  # under torchrun: join the ranks before each makes its batch
        if args.batch_file:
            loaded = torch.load(args.batch_file, weights_only=True, map_location=device)
            batch = loaded if isinstance(loaded, tuple) else tuple(loaded) if isinstance(loaded, list) else (loaded,)
        else:
            batch = _real_batch(shapes, factory, device, args.seed, dp.rank)

        def make_model():
            return factory().to(device)

        def default_optimizer(model):
            return torch.optim.AdamW(model.parameters(), lr=1e-4)

        found = bisect_divergence(step_fn, make_model, make_optimizer or default_optimizer, batch, config=config,
                                  rtol=args.rtol, atol=args.atol, seed=args.seed)
    except (ConfigError, StepfxError, ValueError) as exc:
        print(f"stepfx bisect: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if dp.rank == 0:
        print(found)
    return EXIT_INVALID if found.diverged else EXIT_OK

"""``stepfx export CHECKPOINT_DIR OUT_DIR`` (consolidated safetensors, no GPU
needed: stepfx's answer to zero_to_fp32.py) and ``stepfx import-deepspeed
DS_DIR OUT_DIR`` (a DeepSpeed ZeRO checkpoint as a stepfx one)."""
from __future__ import annotations

import argparse
import os
import pickle
import sys

from .status import EXIT_OK, EXIT_USAGE

__all__ = ["export_arguments", "run_export", "import_deepspeed_arguments", "run_import_deepspeed"]


def _size(text: str) -> int:
    from ..checkpoint.export import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", help="a stepfx checkpoint directory (the one holding 'latest')")
    parser.add_argument("out_dir", help="where model.safetensors (or shards and an index) and config.json go")
    parser.add_argument("--tag", default=None, help="the checkpoint to export (default: the one 'latest' names)")
    parser.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None,
                        help="cast floating tensors to this (default: as saved, the fp32 masters)")
    parser.add_argument("--max-shard-size", type=_size, default="5GB", metavar="SIZE",
                        help="largest shard file, in bytes or with KB/MB/GB/TB (decimal, as transformers; default 5GB)")


def run_export(args: argparse.Namespace) -> int:
    from ..checkpoint.checkpoint import CheckpointError
    from ..checkpoint.export import export_checkpoint

    try:
        written = export_checkpoint(args.checkpoint_dir, args.out_dir, tag=args.tag, dtype=args.dtype,
                                    max_shard_size=args.max_shard_size)
    except (CheckpointError, pickle.UnpicklingError, OSError, ImportError) as exc:
        print(f"stepfx export: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for name in written:
        print(os.path.join(args.out_dir, name))
    return EXIT_OK


def import_deepspeed_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ds_dir", help="a DeepSpeed checkpoint directory (the one holding 'latest')")
    parser.add_argument("out_dir", help="the stepfx checkpoint directory to write (<out_dir>/<tag> and latest)")
    parser.add_argument("--tag", default=None, help="the DeepSpeed checkpoint to import (default: the one 'latest' names)")


def run_import_deepspeed(args: argparse.Namespace) -> int:
    from ..checkpoint.checkpoint import CheckpointError
    from ..checkpoint.deepspeed_import import import_deepspeed

    try:
        path = import_deepspeed(args.ds_dir, args.out_dir, tag=args.tag)
    except (CheckpointError, pickle.UnpicklingError, OSError) as exc:
        print(f"stepfx import-deepspeed: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(path)
    return EXIT_OK

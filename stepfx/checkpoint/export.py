"""Consolidated weights in Hugging Face's safetensors layout: stepfx's
answer to DeepSpeed's ``zero_to_fp32.py``.

Three doors, one writer:

- :func:`write_safetensors` writes a state dict;
- :func:`export_checkpoint` reads a stepfx checkpoint directory on one
  process without GPUs or a process group, a group of tensors at a time;
- :func:`save_pretrained` gathers a live run's model (a collective) and
  rank 0 writes it, with the model's ``config.json`` when it is a
  transformers model.

The layout is the one transformers' ``save_pretrained`` writes and
``from_pretrained`` reads::

    model.safetensors                          when everything fits one shard
    model-00001-of-0000N.safetensors ...       otherwise, and
    model.safetensors.index.json               {"metadata": {"total_size": bytes},
                                                "weight_map": {name: file}}
    config.json, generation_config.json        transformers models only

Shards are cut as huggingface_hub's ``split_torch_state_dict_into_shards``
cuts them: tensors in state-dict order, a new shard whenever the next
tensor would pass ``max_shard_size`` (decimal units, "5GB" = 5e9 bytes), a
tensor larger than that alone in its own shard.

Invariants:

- No name in the output aliases another: safetensors refuses tensors that
  share storage. Names that are the same view of the same storage (tied
  weights) are written once, under the first name (transformers' rule
  applied before that for its models: the names its ``_tied_weights_keys``
  declare as tie targets are the ones dropped); names that share storage
  but are different views are written as copies.
- Only floating tensors take ``dtype``; integer and bool buffers keep theirs.
- Crash safety: every file is written under a temporary name in the output
  directory and renamed into place; the index (or the single
  ``model.safetensors``) is renamed last, and an index of an earlier
  export is removed before any of its shards is replaced. A crash leaves
  either no index or a complete one that names only complete files.
"""
from __future__ import annotations

import copy
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .checkpoint import FORMAT, META_FILE, VERSION, CheckpointError, fsync_dir, resolve_checkpoint
from .storage import SafeReader, read_index

if TYPE_CHECKING:
    from ..api import ParallelStep

__all__ = [
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "export_checkpoint",
    "parse_size",
    "resolve_dtype",
    "save_pretrained",
    "write_safetensors",
]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # huggingface_hub's: decimal
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


# -- options ---------------------------------------------------------------------------
def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or digits and a unit as huggingface_hub
    writes them ("5GB" = 5 * 10**9, "200MB", "10KB")."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    if not isinstance(size, str):
        raise TypeError(f"max_shard_size must be an int or a string like '5GB', got {type(size).__name__}")
    text = size.strip().upper()
    unit = text[-2:]
    try:
        value = float(text[:-2]) if unit in _UNITS else float(text)
    except ValueError:
        raise ValueError(f"max_shard_size {size!r}: expected a number of bytes or digits with KB, MB, GB or TB") from None
    count = int(value * _UNITS.get(unit, 1))
    if count <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return count


def resolve_dtype(dtype: Any) -> torch.dtype | None:
    """``None`` (keep each tensor's dtype), or float32 / float16 / bfloat16
    given as a torch dtype or a name ("fp32", "bf16", "float16", ...)."""
    if dtype is None or dtype in (torch.float32, torch.float16, torch.bfloat16):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype {dtype!r}: choose None (keep), float32, float16 or bfloat16 (or fp32, fp16, bf16)")


def _safetensors_torch():
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError("writing safetensors needs the 'safetensors' package: pip install safetensors") from None
    return safetensors.torch


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = t.detach()
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)  # before the copy to the host: 16-bit copies move half the bytes
    return t.to("cpu").contiguous()


def _out_dtype(src: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and src.is_floating_point else src


# -- what to write ---------------------------------------------------------------------
def _unaliased(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with no two names sharing storage (safetensors' rule): the
    same view under several names (tied weights) is kept under the first;
    different views of one storage become copies."""
    out: dict[str, torch.Tensor] = {}
    seen_views: dict[tuple, str] = {}
    storages: dict[tuple, int] = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: state values must be tensors, got {type(t).__name__}")
        if t.numel() == 0 or t.device.type == "meta":
            out[name] = t
            continue
        storage = (t.device, t.untyped_storage().data_ptr())
        view = (*storage, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if view in seen_views:
            continue  # a tied name: the first name holds the data
        seen_views[view] = name
        storages[storage] = storages.get(storage, 0) + 1
        out[name] = t
    for name, t in out.items():
        if t.numel() and t.device.type != "meta" and storages[(t.device, t.untyped_storage().data_ptr())] > 1:
            out[name] = t.clone()
    return out


def plan_shards(sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    """Names grouped into shards, huggingface_hub's greedy rule: in order, a
    new shard when the next tensor would pass ``max_bytes``, a tensor
    larger than that alone in its own shard."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, size in sizes.items():
        if size > max_bytes:
            shards.append([name])
            continue
        if current and current_bytes + size > max_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current or not shards:
        shards.append(current)
    return shards


# -- files -----------------------------------------------------------------------------
def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


class _Staging:
    """Files written under temporary names in the output directory, renamed
    into place by :meth:`publish` (see the module docstring for the order)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.files: dict[str, str] = {}  # final name -> temporary path

    def path(self, name: str) -> str:
        tmp = os.path.join(self.directory, f".{name}.tmp-{os.getpid()}")
        self.files[name] = tmp
        return tmp

    def write_text(self, name: str, text: str) -> None:
        with open(self.path(name), "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def discard(self) -> None:
        for tmp in self.files.values():
            if os.path.exists(tmp):
                os.remove(tmp)

    def publish(self, entry: str) -> None:
        """Rename every file into place, ``entry`` (the index or the single
        weights file) last; then remove shards of an earlier export."""
        d = self.directory
        stale_entries = [INDEX_NAME] + ([WEIGHTS_NAME] if entry == INDEX_NAME else [])
        for name in stale_entries:  # no earlier index may name files that are being replaced
            if os.path.exists(os.path.join(d, name)):
                os.remove(os.path.join(d, name))
        fsync_dir(d)
        for name, tmp in self.files.items():
            if name != entry:
                os.replace(tmp, os.path.join(d, name))
        fsync_dir(d)
        os.replace(self.files[entry], os.path.join(d, entry))
        for name in os.listdir(d):
            if _SHARD_NAME.fullmatch(name) and name not in self.files:
                os.remove(os.path.join(d, name))
        fsync_dir(d)


def _write(directory: str | os.PathLike, sizes: Mapping[str, int], load: Callable[[list[str]], dict[str, torch.Tensor]],
           *, max_shard_size: int | str, metadata: Mapping[str, str] | None,
           extra_files: Mapping[str, str] | None = None) -> list[str]:
    """Write the shards ``plan_shards(sizes)`` gives, each shard's tensors
    from ``load(names)`` (already cast, contiguous and on the CPU), plus
    ``extra_files`` (name -> text). Returns the written file names."""
    st = _safetensors_torch()
    header = {"format": "pt"}  # transformers checks it on load
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"safetensors metadata must map str to str, got {k!r}: {type(v).__name__}")
        header[k] = v
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    shards = plan_shards(sizes, parse_size(max_shard_size))
    n = len(shards)
    names = [WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    staging = _Staging(directory)
    try:
        for text_name, text in (extra_files or {}).items():
            staging.write_text(text_name, text)
        weight_map: dict[str, str] = {}
        for file_name, shard in zip(names, shards):
            tensors = load(shard)
            path = staging.path(file_name)
            st.save_file(tensors, path, metadata=header)
            _fsync_file(path)
            weight_map.update((k, file_name) for k in shard)
            del tensors
        if n > 1:
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
            staging.write_text(INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")
        staging.publish(INDEX_NAME if n > 1 else WEIGHTS_NAME)
    except BaseException:
        staging.discard()
        raise
    return list(staging.files)


def write_safetensors(state: Mapping[str, torch.Tensor], directory: str | os.PathLike, *, dtype: Any = None,
                      max_shard_size: int | str = "5GB", metadata: Mapping[str, str] | None = None) -> list[str]:
    """Write ``state`` into ``directory`` in Hugging Face's layout (module
    docstring): one ``model.safetensors``, or shards and an index.

    ``dtype`` (None, float32, float16, bfloat16 or their short names) casts
    floating tensors only. ``metadata`` (str -> str) goes into every shard's
    header beside ``"format": "pt"``. Tensors may live on any device; each
    shard is copied to the CPU when it is written. Returns the names of the
    files written, the index (if any) last."""
    return _write_state(state, directory, resolve_dtype(dtype), max_shard_size, metadata, {})


def _write_state(state: Mapping[str, torch.Tensor], directory: str | os.PathLike, dtype: torch.dtype | None,
                 max_shard_size: int | str, metadata: Mapping[str, str] | None, extra: Mapping[str, str]) -> list[str]:
    state = _unaliased(state)
    sizes = {k: t.numel() * _out_dtype(t.dtype, dtype).itemsize for k, t in state.items()}
    return _write(directory, sizes, lambda names: {k: _cast(state[k], dtype) for k in names},
                  max_shard_size=max_shard_size, metadata=metadata, extra_files=extra)


# -- from a checkpoint directory ---------------------------------------------------------
@contextmanager
def _quiet_no_dist() -> Iterator[None]:
    """DCP warns at each load it runs without a process group, which is the point here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _read_meta(path: str) -> dict:
    with open(os.path.join(path, META_FILE)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
        raise CheckpointError(f"{path}: {META_FILE} is not a stepfx checkpoint of version <= {VERSION}")
    return meta


def _config_json(hf_config: Mapping[str, Any], dtype: torch.dtype | None) -> str:
    """transformers' config.json from ``config.to_dict()``, its dtype entry
    saying what the weights are (as save_pretrained sets it)."""
    config = dict(hf_config)
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        config["dtype"] = name
        if "torch_dtype" in config:  # transformers before 4.56 names it so
            config["torch_dtype"] = name
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def export_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tag: str | None = None,
                      dtype: Any = None, max_shard_size: int | str = "5GB") -> list[str]:
    """Export the model of a stepfx checkpoint as safetensors (see the module docstring).

    Reads ``<checkpoint_dir>/latest`` (or ``tag``) and every ``model/...``
    tensor in full on this process's CPU, without GPUs or a process group,
    whatever world size, ZeRO stage or chunking wrote it (DCP reassembles
    the chunks). Memory: one shard's tensors at a time (in the
    checkpoint's dtype, so up to 2x ``max_shard_size`` when casting fp32 to
    16 bits). If the checkpoint recorded a transformers config
    (``hf_config`` in stepfx.json), ``config.json`` is written too, so
    ``from_pretrained(out_dir)`` loads it. Returns the written file names."""
    dtype = resolve_dtype(dtype)
    path = resolve_checkpoint(os.fspath(checkpoint_dir), tag)
    meta = _read_meta(path)
    saved = read_index(path).state_dict_metadata
    order = [k for k in meta.get("model", {}) if f"model/{k}" in saved]  # the module's order, as the saver lists it
    listed = set(order)
    order += [fqn.removeprefix("model/") for fqn in saved
              if fqn.startswith("model/") and fqn.removeprefix("model/") not in listed]
    if not order:
        raise CheckpointError(f"{path}: the checkpoint holds no model/ tensors")
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for key in order:
        md = saved[f"model/{key}"]
        if not hasattr(md, "properties"):
            raise CheckpointError(f"{path}: model/{key} is not a tensor in the checkpoint")
        specs[key] = (tuple(md.size), md.properties.dtype)
    sizes = {k: torch.Size(shape).numel() * _out_dtype(src, dtype).itemsize for k, (shape, src) in specs.items()}

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        tensors = {f"model/{k}": torch.empty(specs[k][0], dtype=specs[k][1]) for k in names}
        with _quiet_no_dist():
            dcp.load(tensors, storage_reader=SafeReader(path), no_dist=True)
        return {k: _cast(tensors.pop(f"model/{k}"), dtype) for k in names}

    extra = {}
    if isinstance(meta.get("hf_config"), dict):
        floating = {specs[k][1] for k in specs if specs[k][1].is_floating_point}
        weights_dtype = dtype or (floating.pop() if len(floating) == 1 else None)
        extra[CONFIG_NAME] = _config_json(meta["hf_config"], weights_dtype)
    return _write(out_dir, sizes, load, max_shard_size=max_shard_size, metadata=None, extra_files=extra)


# -- from a live run ---------------------------------------------------------------------
def _transformers_model(model: Any) -> bool:
    transformers = sys.modules.get("transformers")  # a model can only be one if transformers is imported
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _tie_targets(model: Any) -> list[str]:
    """The names transformers drops when tied weights share storage: its
    expanded ``all_tied_weights_keys`` (5.x, target -> source), else the
    ``_tied_weights_keys`` patterns of every submodule (4.x)."""
    expanded = getattr(model, "all_tied_weights_keys", None)
    if isinstance(expanded, Mapping):
        return [f"^{re.escape(k)}$" for k in expanded]
    patterns = []
    for prefix, module in model.named_modules():
        keys = getattr(module, "_tied_weights_keys", None) or ()
        for key in (keys.keys() if isinstance(keys, Mapping) else keys):
            patterns.append(f"{re.escape(prefix)}\\.{key}" if prefix else key)
    return patterns


def _drop_tied_targets(state: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """transformers' choice of which tied name to keep: among names that are
    the same view of one storage, drop those matching the model's tie
    targets (sorted, at least one kept), so the file holds the source name
    from_pretrained expects."""
    patterns = _tie_targets(model)
    if not patterns:
        return state
    groups: dict[tuple, list[str]] = {}
    for name, t in state.items():
        if t.numel():
            view = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            groups.setdefault(view, []).append(name)
    drop = set()
    for names in groups.values():
        if len(names) < 2:
            continue
        targets = [n for n in sorted(names) if any(re.search(p, n) for p in patterns)]
        drop.update(targets[:len(names) - 1])
    return {k: v for k, v in state.items() if k not in drop}


def _is_writer(step: ParallelStep) -> bool:
    """The one process that writes: data-parallel rank 0 (the only one
    ``model_state_dict(rank0_only=True)`` gives the state to) and global rank 0."""
    dp = step._dp
    if dp is not None and dp.rank != 0:
        return False
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def save_pretrained(step: ParallelStep, directory: str | os.PathLike, *, dtype: Any = None,
                    max_shard_size: int | str = "5GB") -> list[str]:
    """Write the live run's whole model as safetensors (module docstring).

    A collective: every rank must call it (ZeRO-3 gathers the parameter
    pieces). Rank 0 writes — the weights (the user's parameter dtype, i.e.
    the fp32 masters under bf16/fp16 training, unless ``dtype`` casts
    them), and for a transformers ``PreTrainedModel`` its ``config.json``
    (architectures and dtype set as transformers' save_pretrained sets them)
    and ``generation_config.json`` when the model generates — and returns
    the written file names; the other ranks return ``[]`` once the gather
    is done, without waiting for the files."""
    dtype = resolve_dtype(dtype)
    state = step.model_state_dict(rank0_only=True)  # every rank: the gather is a collective
    if not _is_writer(step):
        return []
    model = step._model
    extra: dict[str, str] = {}
    if _transformers_model(model):
        state = _drop_tied_targets(state, model)
        config = copy.deepcopy(model.config)
        config.architectures = [type(model).__name__]
        floating = {t.dtype for t in state.values() if t.is_floating_point()}
        weights_dtype = dtype or (floating.pop() if len(floating) == 1 else None)
        if weights_dtype is not None:
            config.dtype = weights_dtype
        extra[CONFIG_NAME] = config.to_json_string(use_diff=True)
        generation = getattr(model, "generation_config", None)
        if generation is not None and callable(getattr(model, "can_generate", None)) and model.can_generate():
            extra[GENERATION_CONFIG_NAME] = generation.to_json_string(use_diff=True)
    return _write_state(state, directory, dtype, max_shard_size, None, extra)

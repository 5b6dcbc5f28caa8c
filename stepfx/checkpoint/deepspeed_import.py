"""A DeepSpeed ZeRO checkpoint (stages 1, 2, 3) read into a stepfx
checkpoint, so a DeepSpeed run goes on in stepfx.

DeepSpeed's layout, as deepspeed 0.19's engine and ZeRO optimizers write it
(and its ``zero_to_fp32.py`` reads it), checked against checkpoints the real
package wrote (tests/checkpoint/data/)::

    <dir>/latest                                        the newest tag
    <dir>/<tag>/mp_rank_00_model_states.pt              stages 1, 2
    <dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt     stage 3, one per rank
    <dir>/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt  one per data-parallel rank

A model-states file holds the module's ``state_dict`` in the compute dtype
(under stage 3 its parameters are empty), ``buffer_names``,
``param_shapes`` (one ordered ``{name: shape}`` per flat buffer: the
order the optimizer laid the parameters out in), ``shared_params``
(``{alias: name}`` of tied parameters), ``frozen_param_shapes`` /
``frozen_param_fragments`` (parameters that do not train: whole under
stage 2, the rank's piece under stage 3, absent under stage 1, where the
module's state dict has them), ``global_steps``, ``skipped_steps``,
``lr_scheduler`` and ``ds_config``; the keys of the user's ``client_state``
sit beside them. An optim-states file holds ``optimizer_state_dict``:

- Stages 1 and 2: one flat fp32 buffer per parameter group ``g``: its
  parameters in ``param_shapes[g]`` order, each followed by
  ``param_alignment_paddings[g][i]`` elements (zero unless parameter
  alignment was asked for), the whole padded to a multiple of 2 x world
  size and cut into world-size equal partitions, rank ``r`` holding the
  r-th. ``single_partition_of_fp32_groups[g]`` is that partition with its
  padding (``group_paddings[g]``, non-zero on the last rank(s) only) cut
  off; ``base_optimizer_state`` is torch's ``optimizer.state_dict()`` over
  the padded partitions (one "parameter" per group) or, with
  ``elastic_checkpoint``, a list of per-group states with the padding cut.
- Stage 3: each parameter is cut on its own into ``ceil(numel / world)``
  elements per rank, the last piece padded; ``fp32_flat_groups[j]`` (one per
  sub-group, sub-groups in parameter-group order) is the rank's pieces of
  the parameters of ``param_shapes[j]`` back to back; its
  ``optimizer_state_dict`` is torch's, one state per sub-group, of the same
  length as the flat group.

Only data parallelism is read: tensor- or pipeline-parallel checkpoints
(``mp_rank_01``, ``layer_*`` files) and MoE expert groups (partition counts
that differ between groups) are refused with a message.

The files are pickles. They are loaded with ``torch.load(weights_only=True)``,
whose unpickler builds only tensors and plain containers, plus exactly the
globals DeepSpeed's own files name, each replaced by a stand-in that only
holds data (no DeepSpeed import, no code from the file runs):

=========================================================  ==================================
global (measured in deepspeed 0.19.8's files)              stand-in
=========================================================  ==================================
deepspeed.runtime.fp16.loss_scaler.LossScaler (optim)      :class:`DeepSpeedRecord` (attributes)
deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler       the same (fp16 runs; same shape)
deepspeed.runtime.zero.config.ZeroStageEnum (optim)        ``int``
deepspeed.utils.tensor_fragment.fragment_address (optim,   :class:`DeepSpeedRecord`
stages 1-2, ``param_slice_mappings``)
argparse.Namespace (Megatron-DeepSpeed's ``args`` in       ``argparse.Namespace`` (plain data)
client state)
=========================================================  ==================================

Anything else a file names is refused with
:class:`~stepfx.checkpoint.UnsafeCheckpointError`, naming the file and the
global.

The result is a stepfx checkpoint (stepfx/checkpoint/checkpoint.py) of the
whole fp32 parameters and optimizer state per parameter name, written on
one process, so ``load_checkpoint`` reads it into a run of any world size
and ZeRO stage.
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import math
import os
import pickle
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from .checkpoint import FORMAT, META_FILE, VERSION, CheckpointError, encode_json, publish, quiet_single_process, write_file
from .storage import UnsafeCheckpointError

__all__ = ["DeepSpeedImportError", "DeepSpeedRecord", "import_deepspeed", "load_deepspeed_file"]

log = logging.getLogger("stepfx")


class DeepSpeedImportError(CheckpointError):
    """A DeepSpeed checkpoint stepfx cannot read (missing files, a layout it does not know)."""


class DeepSpeedRecord:
    """What stands in for DeepSpeed's own classes in its pickles: the
    attributes the file stored, nothing else (no methods run on load)."""

    def __repr__(self) -> str:
        return f"DeepSpeedRecord({vars(self)})"


def _zero_stage(value: int) -> int:
    """ZeroStageEnum(value), pickled as a call of the enum with its value."""
    return int(value)


_STAND_INS: list[tuple[Any, str]] = [
    (DeepSpeedRecord, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DeepSpeedRecord, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (DeepSpeedRecord, "deepspeed.utils.tensor_fragment.fragment_address"),
    (argparse.Namespace, "argparse.Namespace"),
]

# the model-states keys DeepSpeed writes itself; any other key came from the user's client_state
_DS_MODEL_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info", "ds_autoep_layers", "autoep_layers",
}
_OPTIM_FILE = re.compile(r"(?:\w+_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


def load_deepspeed_file(path: str | os.PathLike) -> Any:
    """One DeepSpeed ``.pt`` file, loaded without running code from it (see
    the module docstring); tensors on the CPU, memory-mapped."""
    path = os.fspath(path)
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)  # a file of torch's legacy format
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(f"{path}: refusing to load this DeepSpeed file: {_refusal(str(e))}; nothing from "
                                    "it was run (the file may have been tampered with)") from None


def _refusal(message: str) -> str:
    """What torch's weights-only unpickler refused, from its long message."""
    found = re.search(r"GLOBAL (\S+)", message)
    if found:
        return f"it asks to load {found.group(1)}, which is none of the data DeepSpeed's checkpoints hold"
    lines = [line.strip() for line in message.split("WeightsUnpickler error:", 1)[-1].splitlines() if line.strip()]
    return f"torch's weights-only unpickler refused it ({lines[0] if lines else 'no reason given'})"


# -- the files of one checkpoint -----------------------------------------------------------
@dataclass
class _Files:
    folder: str
    tag: str
    stage: int
    world: int
    model: list[dict]  # model-states: one (stages 1, 2) or one per rank (stage 3)
    optim: list[dict]  # optimizer_state_dict of each rank, in rank order


def _resolve_tag(ds_dir: str, tag: str | None) -> str:
    if tag is not None:
        return tag
    latest = os.path.join(ds_dir, "latest")
    if not os.path.isfile(latest):
        raise DeepSpeedImportError(f"{ds_dir}: no 'latest' file; pass tag= to name a checkpoint")
    with open(latest) as f:
        return f.read().strip()


def _read_files(ds_dir: str, tag: str | None) -> _Files:
    tag = _resolve_tag(ds_dir, tag)
    folder = os.path.join(ds_dir, tag)
    if not os.path.isdir(folder):
        raise DeepSpeedImportError(f"{folder}: no such checkpoint directory")
    if glob.glob(os.path.join(folder, "layer_*")):
        raise DeepSpeedImportError(f"{folder}: a pipeline-parallel DeepSpeed checkpoint (layer_* files); stepfx reads "
                                   "data-parallel ZeRO checkpoints only (DeepSpeed's ds_to_universal.py converts others)")
    ranks: dict[int, str] = {}
    for path in glob.glob(os.path.join(folder, "*_optim_states.pt")):
        m = _OPTIM_FILE.fullmatch(os.path.basename(path))
        if m is None:
            raise DeepSpeedImportError(f"{path}: not a ZeRO optimizer-states file name stepfx knows")
        if int(m.group(2)) != 0:
            raise DeepSpeedImportError(f"{path}: a tensor-parallel DeepSpeed checkpoint (mp_rank_{m.group(2)}); stepfx "
                                       "reads data-parallel ZeRO checkpoints only")
        ranks[int(m.group(1))] = path
    if not ranks:
        raise DeepSpeedImportError(f"{folder}: no *_optim_states.pt files: not a ZeRO checkpoint (stages 1-3)")
    if sorted(ranks) != list(range(len(ranks))):
        raise DeepSpeedImportError(f"{folder}: optimizer-states files of ranks {sorted(ranks)}: a rank's file is "
                                   "missing")
    optim = []
    for r in range(len(ranks)):
        content = load_deepspeed_file(ranks[r])
        osd = content.get("optimizer_state_dict") if isinstance(content, dict) else None
        if not isinstance(osd, dict) or "zero_stage" not in osd:
            raise DeepSpeedImportError(f"{ranks[r]}: not a ZeRO optimizer-states file (no "
                                       "optimizer_state_dict.zero_stage)")
        optim.append(osd)
    stage = int(optim[0]["zero_stage"])
    counts = optim[0]["partition_count"]
    counts = set(counts) if isinstance(counts, (list, tuple)) else {counts}
    if len(counts) != 1:
        raise DeepSpeedImportError(f"{folder}: parameter groups partitioned over different world sizes {sorted(counts)} "
                                   "(MoE expert groups): not supported")
    world = int(counts.pop())
    if world != len(ranks):
        raise DeepSpeedImportError(f"{folder}: the checkpoint was partitioned over {world} ranks but has {len(ranks)} "
                                   "optimizer-states files (an interrupted or overwritten save?)")
    if stage in (1, 2):
        names = ["mp_rank_00_model_states.pt"]
    elif stage == 3:
        names = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    else:
        raise DeepSpeedImportError(f"{folder}: ZeRO stage {stage}; stepfx imports stages 1, 2 and 3")
    model = []
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise DeepSpeedImportError(f"{path}: missing (ZeRO stage {stage}, {world} ranks)")
        content = load_deepspeed_file(path)
        if not isinstance(content, dict) or "param_shapes" not in content or "module" not in content:
            raise DeepSpeedImportError(f"{path}: not a DeepSpeed model-states file of a ZeRO run (no param_shapes)")
        model.append(content)
    return _Files(folder, tag, stage, world, model, optim)


# -- reassembly --------------------------------------------------------------------------
@dataclass
class _Whole:
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # trained, fp32
    state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # param -> state key -> whole tensor
    group: dict[str, int] = field(default_factory=dict)  # param -> torch parameter group


def _numel(shape: Any) -> int:
    return math.prod(tuple(shape))


def _split_state(state: dict, length: int, where: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A flat group's optimizer state: (per-element tensors of ``length``, scalars such as ``step``)."""
    vectors, scalars = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.numel() != length:
                raise DeepSpeedImportError(f"{where}: optimizer state {key!r} has {value.numel()} elements, the flat "
                                           f"parameter group {length}")
            vectors[key] = value
        elif isinstance(value, torch.Tensor):
            scalars[key] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            scalars[key] = torch.tensor(float(value))  # torch before 1.12 kept Adam's step as a number
        else:
            raise DeepSpeedImportError(f"{where}: optimizer state {key!r} is a {type(value).__name__}, not a tensor")
    return vectors, scalars


def _same_scalars(per_rank: list[dict[str, torch.Tensor]], where: str) -> dict[str, torch.Tensor]:
    first = per_rank[0]
    for r, other in enumerate(per_rank[1:], 1):
        if other.keys() != first.keys() or any(not torch.equal(other[k], first[k]) for k in first):
            raise DeepSpeedImportError(f"{where}: ranks 0 and {r} disagree on the optimizer's scalar state "
                                       f"{ {k: float(v) for k, v in first.items()} }")
    return first


def _zero12(files: _Files) -> _Whole:
    """Stages 1 and 2 (see the module docstring): a group's rank partitions
    concatenated are its flat buffer less the final padding; parameters are
    read off it in ``param_shapes`` order."""
    out = _Whole()
    ms, world = files.model[0], files.world
    shapes = ms["param_shapes"]
    alignment = files.optim[0].get("param_alignment_paddings")
    for g, group_shapes in enumerate(shapes):
        where = f"{files.folder}: parameter group {g}"
        flat_parts, vector_parts, scalar_parts = [], [], []
        for r, osd in enumerate(files.optim):
            part = osd["single_partition_of_fp32_groups"][g]
            base = osd["base_optimizer_state"]
            if isinstance(base, dict):  # torch's optimizer.state_dict() over padded partitions
                index = base["param_groups"][g]["params"]
                if len(index) != 1:
                    raise DeepSpeedImportError(f"{where}: expected one flat partition per group, got {len(index)}")
                padding = int(osd["group_paddings"][g])
                state = base["state"].get(index[0], {})
                vectors, scalars = _split_state(state, part.numel() + padding, f"{where}, rank {r}")
                vectors = {k: v[:part.numel()] for k, v in vectors.items()}
            else:  # elastic_checkpoint: per-group states, padding already cut
                vectors, scalars = _split_state(base[g], part.numel(), f"{where}, rank {r}")
            flat_parts.append(part)
            vector_parts.append(vectors)
            scalar_parts.append(scalars)
        flat = torch.cat(flat_parts)
        vectors = {k: torch.cat([v[k] for v in vector_parts]) for k in vector_parts[0]}
        scalars = _same_scalars(scalar_parts, where)
        paddings = alignment[g] if alignment is not None else [0] * len(group_shapes)
        if len(paddings) != len(group_shapes):
            raise DeepSpeedImportError(f"{where}: {len(paddings)} alignment paddings for {len(group_shapes)} parameters")
        offset = 0
        for (name, shape), pad in zip(group_shapes.items(), paddings):
            n = _numel(shape)
            if offset + n > flat.numel():
                raise DeepSpeedImportError(f"{where}: {name} ends at element {offset + n}, past the group's "
                                           f"{flat.numel()}")
            out.params[name] = flat[offset:offset + n].view(tuple(shape)).clone()
            out.state[name] = {k: v[offset:offset + n].view(tuple(shape)).clone() for k, v in vectors.items()}
            out.state[name].update((k, v.clone()) for k, v in scalars.items())
            out.group[name] = g
            offset += n + int(pad)
        align = 2 * world  # what DeepSpeed pads each group to; its own zero_to_fp32 checks the same
        if math.ceil(offset / align) != math.ceil(flat.numel() / align):
            raise DeepSpeedImportError(f"{where}: the parameters take {offset} elements, the group holds {flat.numel()}: "
                                       "the layout is not the one stepfx knows")
    return out


def _zero3(files: _Files) -> _Whole:
    """Stage 3 (see the module docstring): every parameter's pieces, one per
    rank at the same offset of each rank's flat sub-group, concatenated
    and cut to its size."""
    out = _Whole()
    world = files.world
    shapes = files.model[0]["param_shapes"]
    for r, ms in enumerate(files.model[1:], 1):
        if [list(s) for s in ms["param_shapes"]] != [list(s) for s in shapes]:
            raise DeepSpeedImportError(f"{files.folder}: ranks 0 and {r} list different parameters")
    torch_sd = files.optim[0]["optimizer_state_dict"]
    group_of_sub = {j: g for g, pg in enumerate(torch_sd["param_groups"]) for j in pg["params"]}
    subs = len(files.optim[0]["fp32_flat_groups"])
    if len(shapes) != subs or set(group_of_sub) != set(range(subs)):
        raise DeepSpeedImportError(f"{files.folder}: {len(shapes)} parameter lists for {subs} flat sub-groups")
    for j, group_shapes in enumerate(shapes):
        where = f"{files.folder}: sub-group {j}"
        flats, vector_parts, scalar_parts = [], [], []
        for r, osd in enumerate(files.optim):
            flat = osd["fp32_flat_groups"][j]
            state = osd["optimizer_state_dict"]["state"].get(j, {})
            vectors, scalars = _split_state(state, flat.numel(), f"{where}, rank {r}")
            flats.append(flat)
            vector_parts.append(vectors)
            scalar_parts.append(scalars)
        if len({f.numel() for f in flats}) != 1:
            raise DeepSpeedImportError(f"{where}: the ranks' pieces differ in size {[f.numel() for f in flats]}")
        scalars = _same_scalars(scalar_parts, where)
        offset = 0
        for name, shape in group_shapes.items():
            n = _numel(shape)
            piece = math.ceil(n / world)
            if offset + piece > flats[0].numel():
                raise DeepSpeedImportError(f"{where}: {name} ends past the sub-group's {flats[0].numel()} elements")
            out.params[name] = torch.cat([f[offset:offset + piece] for f in flats])[:n].view(tuple(shape)).clone()
            out.state[name] = {k: torch.cat([v[k][offset:offset + piece] for v in vector_parts])[:n]
                               .view(tuple(shape)).clone() for k in vector_parts[0]}
            out.state[name].update((k, v.clone()) for k, v in scalars.items())
            out.group[name] = group_of_sub[j]
            offset += piece
        if offset != flats[0].numel():
            raise DeepSpeedImportError(f"{where}: the parameters take {offset} elements per rank, the sub-group holds "
                                       f"{flats[0].numel()}: the layout is not the one stepfx knows")
    return out


def _frozen(files: _Files, trained: dict[str, torch.Tensor], master: torch.dtype) -> dict[str, torch.Tensor]:
    """Parameters that do not train, in the masters' dtype (DeepSpeed keeps
    them only in the compute dtype, from which the cast up is exact)."""
    ms = files.model[0]
    shapes = ms.get("frozen_param_shapes")
    out: dict[str, torch.Tensor] = {}
    if shapes:
        for name, shape in shapes.items():
            n = _numel(shape)
            if files.stage == 3:
                value = torch.cat([m["frozen_param_fragments"][name].reshape(-1) for m in files.model])[:n]
            else:
                value = ms["frozen_param_fragments"][name]
            out[name] = value.reshape(tuple(shape))
    else:  # stage 1 records none: the module's state dict holds them whole
        skip = set(trained) | set(ms["buffer_names"]) | set(ms.get("shared_params") or {})
        for key, value in ms["module"].items():
            if key not in skip and isinstance(value, torch.Tensor) and value.numel():
                out[key] = value
    return {k: (v.to(master) if v.is_floating_point() else v).clone() for k, v in out.items()}


# -- the stepfx checkpoint -------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """Client state and configs as JSON-able data: Namespaces as dicts,
    DeepSpeed stand-ins dropped (None)."""
    if isinstance(value, argparse.Namespace):
        return {k: _plain(v) for k, v in vars(value).items()}
    if isinstance(value, DeepSpeedRecord):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if isinstance(k, (str, int))}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    return repr(value)


def _optimizer_type(groups: list[dict], ds_config: dict) -> str:
    """The torch class name stepfx's loader compares with the run's
    optimizer: torch's Adam family records ``decoupled_weight_decay`` in its
    groups; DeepSpeed's config names its own (``Adam`` is AdamW unless
    ``adam_w_mode`` is false)."""
    if groups and "decoupled_weight_decay" in groups[0]:
        return "AdamW" if groups[0]["decoupled_weight_decay"] else "Adam"
    block = ds_config.get("optimizer") if isinstance(ds_config, dict) else None
    if isinstance(block, dict) and isinstance(block.get("type"), str):
        kind = block["type"]
        if kind.lower() in ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"):
            params = block.get("params") or {}
            return "AdamW" if kind.lower() == "adamw" or params.get("adam_w_mode", True) else "Adam"
        return kind
    return "unknown"


def _param_groups(files: _Files, whole: _Whole, ds_config: dict) -> tuple[str, list[dict]]:
    base = files.optim[0].get("base_optimizer_state", files.optim[0].get("optimizer_state_dict"))
    if isinstance(base, dict) and "param_groups" in base:
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]]
    else:  # elastic: the groups' hyperparameters are not in the files; the config's are the best record
        block = ds_config.get("optimizer") if isinstance(ds_config, dict) else None
        params = dict((block or {}).get("params") or {})
        hyper = [dict(params) for _ in range(1 + max(whole.group.values(), default=-1))]
    groups = []
    for g, h in enumerate(hyper):
        group = {k: (float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in h.items()}
        group = {k: v for k, v in group.items() if v is None or isinstance(v, (bool, int, float, str, list, tuple))}
        group["params"] = [n for n in whole.params if whole.group[n] == g]
        groups.append(group)
    return _optimizer_type(hyper, ds_config), groups


def _accumulation(ds_config: dict, world: int) -> int:
    gas = ds_config.get("gradient_accumulation_steps")
    if isinstance(gas, int) and gas > 0:
        return gas
    total, micro = ds_config.get("train_batch_size"), ds_config.get("train_micro_batch_size_per_gpu")
    if isinstance(total, int) and isinstance(micro, int) and micro > 0 and total % (micro * world) == 0:
        return max(1, total // (micro * world))
    return 1


def _precision(ds_config: dict) -> str:
    def enabled(key: str) -> bool:
        block = ds_config.get(key)
        return isinstance(block, dict) and block.get("enabled") is True

    return "fp16" if enabled("fp16") else "bf16" if enabled("bf16") or enabled("bfloat16") else "fp32"


def _model_tensors(files: _Files, whole: _Whole) -> dict[str, torch.Tensor]:
    """Trained and frozen parameters and buffers, in the module's state-dict
    order; buffers' floating values as fp32 (as DeepSpeed's zero_to_fp32)."""
    ms = files.model[0]
    master = next(iter(whole.params.values())).dtype if whole.params else torch.float32
    frozen = _frozen(files, whole.params, master)
    names = set(ms["buffer_names"])
    buffers = {k: (v.float() if v.is_floating_point() else v).clone() for k, v in ms["module"].items() if k in names}
    model = {**whole.params, **frozen, **buffers}
    order = [k for k in ms["module"] if k in model] + [k for k in model if k not in ms["module"]]
    return {k: model[k] for k in order}


def _metadata(files: _Files, whole: _Whole, model: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> dict:
    """stepfx.json: the saver's keys (checkpoint.py), the client state's
    tensors added to ``tensors`` as ``client/<i>``, and what DeepSpeed recorded."""
    ms = files.model[0]
    ds_config = _plain(ms.get("ds_config")) if isinstance(ms.get("ds_config"), dict) else {}
    kind, groups = _param_groups(files, whole, ds_config)
    client = {k: _plain(v) for k, v in ms.items() if k not in _DS_MODEL_KEYS}
    client_tensors: dict[str, torch.Tensor] = {}
    try:
        client_json = encode_json(client, "client_state", client_tensors, "client/")
    except CheckpointError as e:
        log.warning("stepfx: %s: the DeepSpeed client state is not kept (%s)", files.folder, e)
        client_json, client_tensors = {"__dict__": []}, {}
    tensors.update(client_tensors)
    updates = int(ms.get("global_steps") or 0)
    meta: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "world_size": files.world, "zero_stage": files.stage,
        "precision": _precision(ds_config), "torch": torch.__version__,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "updates": updates,
        "micro_steps": updates * _accumulation(ds_config, files.world),
        "model": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in model.items()},
        "client_state": client_json,
        "optimizer": {"type": kind, "param_groups": encode_json(groups, "optimizer.param_groups", {}, "x")},
        "source": "deepspeed",
        "deepspeed": {
            "version": ms.get("ds_version"), "tag": files.tag, "global_steps": updates,
            "global_samples": ms.get("global_samples"), "skipped_steps": ms.get("skipped_steps"),
            "loss_scale": getattr(files.optim[0].get("loss_scaler"), "cur_scale", None),
            "tied": _plain(ms.get("shared_params") or {}),
            "config": json.loads(json.dumps(ds_config, default=repr)),
        },
    }
    scheduler = ms.get("lr_scheduler")
    if isinstance(scheduler, dict):
        block = ds_config.get("scheduler") if isinstance(ds_config.get("scheduler"), dict) else {}
        try:
            meta["lr_scheduler"] = {"type": block.get("type", "unknown"),
                                    "state": encode_json(_plain(scheduler), "lr_scheduler", {}, "x")}
        except CheckpointError as e:
            log.warning("stepfx: %s: the lr scheduler's state is not kept (%s)", files.folder, e)
    return meta


def import_deepspeed(ds_checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                     tag: str | None = None) -> str:
    """Read DeepSpeed ZeRO checkpoint ``tag`` (default: what ``latest``
    names) of ``ds_checkpoint_dir`` and write it as stepfx checkpoint
    ``<out_dir>/<tag>``, then point ``<out_dir>/latest`` at it; returns its path.

    Written: ``model/<name>`` for every trained parameter (DeepSpeed's fp32
    masters, bitwise), frozen parameter (cast up from the compute dtype,
    DeepSpeed keeps no other copy) and buffer (floating ones as fp32, as
    DeepSpeed's zero_to_fp32 does); tied aliases only under the name the
    module's ``named_parameters`` gives first, as stepfx's own checkpoints;
    ``optim/<name>/<key>`` for the whole optimizer state of each trained
    parameter (``exp_avg``, ``exp_avg_sq``, ``step`` for Adam); the client
    state's JSON-able values and tensors; and in stepfx.json the step
    counts, the parameter groups' hyperparameters and names, the lr
    scheduler's state, ``"source": "deepspeed"`` and what DeepSpeed recorded
    (version, config, loss scale, tied names).

    One process, no GPU, no process group; memory: the whole checkpoint.
    Crash-safe like stepfx's saver: written as ``<out_dir>/.<tag>.partial``,
    renamed, and only then ``latest`` replaced. Refuses to overwrite an
    existing ``<out_dir>/<tag>``."""
    ds_dir, out_dir = os.fspath(ds_checkpoint_dir), os.fspath(out_dir)
    files = _read_files(ds_dir, tag)
    final = os.path.join(out_dir, files.tag)
    if os.path.exists(final):
        raise DeepSpeedImportError(f"{final} exists; import into another directory or remove it first")
    whole = _zero3(files) if files.stage == 3 else _zero12(files)
    model = _model_tensors(files, whole)
    tensors = {f"model/{k}": v for k, v in model.items()}
    for name, state in whole.state.items():
        tensors.update((f"optim/{name}/{key}", value) for key, value in state.items())
    meta = _metadata(files, whole, model, tensors)

    os.makedirs(out_dir, exist_ok=True)
    partial = os.path.join(out_dir, f".{files.tag}.partial")
    if os.path.exists(partial):
        shutil.rmtree(partial)  # an import that died: nothing points at it
    with quiet_single_process():
        dcp.save(tensors, storage_writer=FileSystemWriter(partial), no_dist=True)
    write_file(os.path.join(partial, META_FILE), json.dumps(meta, indent=1, allow_nan=True))
    publish(out_dir, files.tag, partial)
    log.info("stepfx: imported DeepSpeed %s checkpoint %s (ZeRO-%d, %d ranks) into %s", meta["deepspeed"]["version"],
             files.folder, files.stage, files.world, final)
    return final

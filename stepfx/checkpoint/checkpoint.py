"""``save_checkpoint`` / ``load_checkpoint``: a training run saved and resumed.

Layout (DeepSpeed's conventions where it has them)::

    <dir>/latest              the tag of the newest complete checkpoint
    <dir>/<tag>/              a torch.distributed.checkpoint directory:
        .metadata, __<rank>_<n>.distcp   tensors, each rank writing what it holds
        stepfx.json                      everything else, as JSON (no pickles)

Tensors, each under its logical (whole) shape whatever the layout that
wrote it (chunks, see layout.py), so a run of another world size, ZeRO stage,
tensor-parallel degree or precision reads exactly its own pieces (a
tensor-parallel rank writes its Megatron shard as the boxes it covers in the
whole tensor: a fused q/k/v weight's shard is three blocks apart; a ZeRO
piece of a shard is cut into boxes of the shard first):

    model/<parameter name or buffer key>   parameters (the user's dtype: the fp32
                                           masters under bf16/fp16) and buffers
    optim/<parameter name>/<state key>     optimizer state (exp_avg, step, ...)
    runtime/<name>                         stepfx's own state (the fp16 loss scale
                                           and its counters)
    rng/<rank>/<generator>                 each rank's random number generators
    client/<path>                          tensors of the user's client_state

Crash safety: ranks write into ``<dir>/.<tag>.partial``; DCP writes its
``.metadata`` only after every rank's files are written; rank 0 then adds
``stepfx.json``, renames the directory to ``<tag>`` and only then replaces
``latest`` (write to a temporary file, ``os.replace``). A save killed at any
point leaves ``latest`` naming the previous complete checkpoint. Re-saving
an existing tag moves the old one to ``.<tag>.old`` for the instant of the
swap, and loading falls back to it.

Loading reads into fresh tensors and installs them only once every rank
has read everything, so a failed load leaves the run as it was.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from ..graph import Role, Storage, TensorSpec
from ..graph.tp_layout import TP_PLAN_KEY, TensorSplit
from ..runtime.emptied import reading_emptied
from .layout import Chunk, ChunkLoadPlanner, ChunkSavePlanner, chunks_of
from .storage import SafeReader, read_index

if TYPE_CHECKING:
    from ..api import ParallelStep

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "resolve_checkpoint", "encode_json", "decode_json",
           "fsync_dir", "write_file", "publish", "quiet_single_process", "FORMAT", "VERSION"]

log = logging.getLogger("stepfx")

FORMAT = "stepfx-checkpoint"
VERSION = 1
LATEST = "latest"
META_FILE = "stepfx.json"


@contextmanager
def quiet_single_process():
    """DCP warns at every save or load it runs without collectives, which
    stepfx asks for on purpose (one process; or loads each rank plans alone)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as asked (the message says why)."""


# -- what this rank holds ----------------------------------------------------------
@dataclass
class _Holding:
    """A tensor of the run as this rank holds it: ``value`` is the whole
    tensor (``piece`` None) or the flat range ``piece`` of it; ``where``
    says how a loaded value is installed."""

    fqn: str
    shape: tuple[int, ...]
    value: torch.Tensor
    piece: tuple[int, int] | None
    where: tuple
    split: TensorSplit | None = None  # a tensor-parallel shard: ``value`` (or its ``piece``) is of the shard

    def chunks(self, tensor: torch.Tensor) -> list[Chunk]:
        """The boxes of the logical tensor that ``tensor`` (this holding's value, or a fresh one like
        it to read into) holds: a whole tensor or a ZeRO piece of it; under tensor parallelism the
        piece is of the rank's shard, whose ``parts`` fused parts (q, k, v) lie apart in the whole."""
        if self.split is None:
            return chunks_of(self.fqn, self.shape, tensor, self.piece)
        split, d = self.split, self.split.dim
        local = chunks_of(self.fqn, split.local_shape(self.shape), tensor, self.piece)
        widths = split.part_sizes(self.shape[d])  # the fused parts of the whole
        whole_at = [sum(widths[:p]) for p in range(len(widths))]
        mine = [w // split.count for w in widths]  # this rank's slice of each
        local_at = [sum(mine[:p]) for p in range(len(mine))]
        out = []
        for c in local:
            start, size = c.offsets[d], c.sizes[d]
            for part in range(split.parts):
                lo, hi = max(start, local_at[part]), min(start + size, local_at[part] + mine[part])
                if lo >= hi:
                    continue
                at = whole_at[part] + split.index * mine[part] + lo - local_at[part]
                offsets = c.offsets[:d] + (at,) + c.offsets[d + 1:]
                sizes = c.sizes[:d] + (hi - lo,) + c.sizes[d + 1:]
                out.append(Chunk(self.fqn, self.shape, offsets, sizes, c.tensor.narrow(d, lo - start, hi - lo)))
        return out


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _pipeline_owner(step: "ParallelStep"):
    """Under pipeline parallelism every rank binds the whole model but keeps
    only its stages' parameters (and their optimizer state) up to date:
    whether this rank's copy of a parameter is the one to write."""
    plan = getattr(step, "_last", None)
    programs = getattr(getattr(plan, "executor", None), "programs", None)
    if programs is None:
        return lambda name: True
    mine, owner = set(plan.executor.my_stages), programs.plan.owner
    return lambda name: owner.get(name, 0) in mine


def _holdings(step: "ParallelStep", model: torch.nn.Module, optimizer, *, rank: int, saving: bool = False) -> list[_Holding]:
    """Every tensor of the run this rank holds, wherever it lives: the
    rank's store (ZeRO pieces, step counters, the loss scaler's state) first,
    then the user's module and optimizer for what the store does not hold."""
    store = step._store
    out: list[_Holding] = []
    in_store: set[tuple] = set()
    owns = _pipeline_owner(step) if saving else (lambda name: True)  # a load fills every copy (tied ones are read)
    # tensor parallelism: a split parameter's tensors (it, and its optimizer state: the same shape) are
    # this rank's shard, or a ZeRO piece of the shard (whose slot no longer names the split)
    plan = getattr(step, "_last", None)
    signature = getattr(getattr(plan, "graph", None), "signature", None)
    tp_plan = signature.extra.get(TP_PLAN_KEY) if signature is not None else None
    for ident, value in store.tensors.items():
        if ident in store.carried:
            continue  # compute copies of parameters: made again from them
        role, name, key, _, storage, piece = ident
        if role in (Role.PARAM, Role.OPTIMIZER_STATE) and not owns(name):
            continue  # another pipeline stage's (a tensor-parallel shard of it, say): up to date there only
        if role is Role.GRAD:
            raise CheckpointError(
                f"this rank holds accumulated gradients (of {name}): save at an optimizer update, not in the middle "
                "of gradient accumulation (DeepSpeed saves at update boundaries too)")
        if role is Role.PARAM:
            spec = store.held.get((role, name, None))
            fqn, shape = f"model/{name}", tuple(spec.shape) if isinstance(spec, TensorSpec) else tuple(value.shape)
        elif role is Role.OPTIMIZER_STATE:
            spec = store.held.get((role, name, key))
            fqn = f"optim/{name}/{key}"
            shape = tuple(spec.shape) if isinstance(spec, TensorSpec) else tuple(value.shape)
        elif role is Role.RUNTIME_STATE and storage is Storage.RANK:
            fqn, shape = f"runtime/{name}", tuple(value.shape)
        else:
            continue
        split = tp_plan.split_of(name) if tp_plan is not None and role is not Role.RUNTIME_STATE else None
        if split is not None and len(shape) <= split.dim:
            split = None  # a whole scalar of a split parameter (a step counter)
        if split is not None and piece is None and tuple(value.shape) == tuple(shape):
            shape = tuple(shape[i] * (split.count if i == split.dim else 1) for i in range(len(shape)))
        out.append(_Holding(fqn, shape, value, piece, ("store", ident), split))
        in_store.add((role, name, key))
    held = store.held
    for name, p in model.named_parameters():
        if (Role.PARAM, name, None) in in_store or isinstance(held.get((Role.PARAM, name, None)), TensorSpec) and p.numel() == 0:
            continue  # in pieces (ZeRO-3): this rank's are above, the others' on their ranks
        if not owns(name):
            continue  # another pipeline stage's: up to date (and written) there only
        out.append(_Holding(f"model/{name}", tuple(p.shape), p.detach(), None, ("param", name)))
    params = {id(p) for p in model.parameters()}
    with reading_emptied():  # its buffers; an emptied module's parameters come from the pieces
        entries = model.state_dict(keep_vars=True)
    for key, b in entries.items():
        if id(b) not in params and isinstance(b, torch.Tensor):
            out.append(_Holding(f"model/{key}", tuple(b.shape), b.detach(), None, ("buffer", key)))
    if optimizer is not None:
        names = _param_names(model)
        for p, state in optimizer.state.items():
            name = names.get(id(p))
            for key, value in state.items():
                if name is not None and isinstance(value, torch.Tensor) and (Role.OPTIMIZER_STATE, name, key) not in in_store \
                        and owns(name) and not (value.numel() == 0 and isinstance(held.get((Role.OPTIMIZER_STATE, name, key)),
                                                                                    TensorSpec)):
                    out.append(_Holding(f"optim/{name}/{key}", tuple(value.shape), value.detach(), None, ("optim", name, key)))
    return out


def _rng_tensors(rank: int) -> dict[str, torch.Tensor]:
    """This rank's generators: torch's CPU and current CUDA device, Python's
    ``random`` (and NumPy's global one when NumPy is loaded) as int64 tensors."""
    out = {f"rng/{rank}/torch": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"rng/{rank}/cuda"] = torch.cuda.get_rng_state()
    version, internal, gauss = random.getstate()
    out[f"rng/{rank}/python"] = torch.tensor([version, *internal], dtype=torch.int64)
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        if kind == "MT19937":
            out[f"rng/{rank}/numpy"] = torch.tensor([*map(int, keys), pos, has_gauss], dtype=torch.int64)
            out[f"rng/{rank}/numpy_gauss"] = torch.tensor(cached, dtype=torch.float64)
    return out


def _set_rng(values: dict[str, torch.Tensor], rank: int) -> None:
    if (t := values.get(f"rng/{rank}/torch")) is not None:
        torch.random.set_rng_state(t)
    if (t := values.get(f"rng/{rank}/cuda")) is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(t)
    if (t := values.get(f"rng/{rank}/python")) is not None:
        state = t.tolist()
        random.setstate((state[0], tuple(state[1:]), None))
    np = sys.modules.get("numpy")
    if np is not None and (t := values.get(f"rng/{rank}/numpy")) is not None:
        state = t.tolist()
        np.random.set_state(("MT19937", np.array(state[:-2], dtype=np.uint32), state[-2], state[-1],
                             float(values[f"rng/{rank}/numpy_gauss"])))


# -- JSON for the rest ------------------------------------------------------------
def encode_json(value: Any, where: str, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """``value`` as JSON; tensors go to ``tensors`` under ``prefix`` and are
    referenced as ``{"__tensor__": fqn}``. Anything else is refused (no
    pickles: a checkpoint must load without running code)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        fqn = f"{prefix}{len(tensors)}"
        tensors[fqn] = value.detach()
        return {"__tensor__": fqn}
    if isinstance(value, (list, tuple)):
        items = [encode_json(v, f"{where}[{i}]", tensors, prefix) for i, v in enumerate(value)]
        return items if isinstance(value, list) else {"__tuple__": items}
    if isinstance(value, dict):
        if not all(isinstance(k, (str, int)) for k in value):
            raise CheckpointError(f"{where}: dict keys must be str or int to be saved without pickling")
        return {"__dict__": [[k, encode_json(v, f"{where}[{k!r}]", tensors, prefix)] for k, v in value.items()]}
    raise CheckpointError(
        f"{where}: a {type(value).__name__} cannot be saved without pickling (stepfx checkpoints load without "
        "running code): use numbers, strings, lists, dicts and tensors")


def decode_json(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [decode_json(v, tensors) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensors[value["__tensor__"]]
        if "__tuple__" in value:
            return tuple(decode_json(v, tensors) for v in value["__tuple__"])
        return {k: decode_json(v, tensors) for k, v in value["__dict__"]}
    return value


def _param_groups(model: torch.nn.Module, optimizer) -> list[dict]:
    names = _param_names(model)
    groups = []
    for g in optimizer.param_groups:
        group = {k: (float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in g.items() if k != "params"}
        group = {k: v for k, v in group.items() if v is None or isinstance(v, (bool, int, float, str, list, tuple))}
        group["params"] = [names.get(id(p), f"<unnamed {i}>") for i, p in enumerate(g["params"])]
        groups.append(group)
    return groups


# -- save ---------------------------------------------------------------------------
def _world(step: "ParallelStep") -> tuple[int, int, Any]:
    dp = step._dp
    if dp is not None and dp.active:
        return dp.rank, dp.world_size, dp.group
    return 0, 1, None


def _agree(group: Any, value: Any, what: str) -> None:
    """Every rank passed the same ``value`` (a directory, a tag): a save
    with ranks writing to different places would never complete."""
    if group is None:
        return
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    if any(v != everyone[0] for v in everyone):
        raise CheckpointError(f"the ranks passed different {what}: {everyone}")


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _reached(point: str) -> None:
    """A seam for the crash tests, which replace it to kill the process at
    ``point`` of a save; does nothing otherwise."""


def publish(directory: str, tag: str, partial: str) -> None:
    """Rank 0, after every rank's files and DCP's index are written: the
    partial directory becomes ``tag``, then ``latest`` names it."""
    final = os.path.join(directory, tag)
    old = os.path.join(directory, f".{tag}.old")
    if os.path.exists(final):
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(final, old)
        _reached("old_moved")
    os.replace(partial, final)
    fsync_dir(directory)
    _reached("renamed")
    write_file(os.path.join(directory, LATEST), tag)
    fsync_dir(directory)
    _reached("published")
    if os.path.exists(old):
        shutil.rmtree(old, ignore_errors=True)


class PendingSave:
    """An asynchronous save under way. Rank 0 publishes the checkpoint
    (``stepfx.json``, the rename, ``latest``) as soon as the background write
    completes, whether or not anyone waits; :meth:`wait` returns the path
    once it is published and re-raises a failure of the write or of the
    publishing."""

    def __init__(self, future: Any, finish: Any, started: float):
        self._future = future
        self._finish = finish
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self.started = started
        self.finished_at: float | None = None
        self.path: str | None = None
        future.add_done_callback(lambda _: self._complete())

    def _complete(self) -> None:
        with self._lock:  # once: from the writer's completion callback or from wait(), whichever comes first
            if self.finished_at is not None or self._error is not None:
                return
            try:
                self._future.result()
                self.path = self._finish()
                self.finished_at = time.perf_counter()
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
                self._error = exc

    def done(self) -> bool:
        return self.finished_at is not None or self._error is not None

    def wait(self) -> str:
        try:
            self._future.result()
        except BaseException:  # noqa: BLE001 - recorded by _complete
            pass
        self._complete()
        if self._error is not None:
            raise self._error
        return self.path


def save_checkpoint(step: "ParallelStep", directory: str, tag: str | None = None, client_state: dict | None = None,
                    *, async_save: bool = False) -> str | PendingSave:
    """Save the run (see the module docstring). A collective: every rank
    calls it with the same directory and tag. Returns the checkpoint's
    path, or with ``async_save`` a :class:`PendingSave` once the state is
    staged in host memory (training may go on; the next save or load, or
    ``step.wait_checkpoint()``, waits for it)."""
    if step._model is None:
        raise CheckpointError(f"{step.__name__} has not run yet: there is nothing to save beyond the model itself")
    step.wait_checkpoint()
    if step._schedule_pending:
        step._check_loss_scale(wait=True)  # the scheduler's pending advance is part of the state
    model, optimizer = step._model, step.optimizer
    rank, world, group = _world(step)
    updates = step.updates
    tag = tag if tag is not None else f"global_step{updates}"
    if not tag or os.sep in tag or tag.startswith("."):
        raise CheckpointError(f"tag {tag!r}: must be a plain, non-empty directory name not starting with '.'")
    directory = os.path.abspath(os.fspath(directory))
    _agree(group, (directory, tag), "checkpoint directories/tags")
    partial = os.path.join(directory, f".{tag}.partial")
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        if os.path.exists(partial):
            shutil.rmtree(partial)  # a save killed earlier
        os.makedirs(partial)
    if group is not None:
        dist.barrier(group=group)

    holdings = _holdings(step, model, optimizer, rank=rank, saving=True)
    shapes = {h.fqn: h.shape for h in holdings}
    state: dict[str, torch.Tensor] = {}
    for h in holdings:
        for c in h.chunks(h.value):
            # (a row-parallel shard's box is a column block: copied, as DCP writes contiguous tensors)
            state[ChunkSavePlanner.key(c.fqn, c.offsets)] = c.tensor if c.tensor.is_contiguous() else c.tensor.contiguous()
    rng = _rng_tensors(rank)
    client_tensors: dict[str, torch.Tensor] = {}
    client_json = encode_json(client_state or {}, "client_state", client_tensors, "client/")
    extra = {**rng, **(client_tensors if rank == 0 else {})}  # client_state: rank 0's, as DeepSpeed keeps it
    for fqn, t in extra.items():
        shapes[fqn] = tuple(t.shape)
        state[ChunkSavePlanner.key(fqn, (0,) * t.dim())] = t
    meta = _metadata(step, model, optimizer, world, updates, client_json) if rank == 0 else None

    writer = FileSystemWriter(partial, single_file_per_rank=True, sync_files=True)
    planner = ChunkSavePlanner(shapes)

    def finish() -> str:
        _reached("data_written")
        if rank == 0:
            write_file(os.path.join(partial, META_FILE), json.dumps(meta, indent=1, allow_nan=True))
            _reached("meta_written")
            publish(directory, tag, partial)
            log.info("stepfx: %s: checkpoint %s saved (%d ranks)", step.__name__, os.path.join(directory, tag), world)
        return os.path.join(directory, tag)

    started = time.perf_counter()
    if not async_save:
        with quiet_single_process():
            dcp.save(state, storage_writer=writer, planner=planner, process_group=group, no_dist=group is None)
        path = finish()
        if group is not None:
            dist.barrier(group=group)  # every rank returns once the checkpoint is complete
        return path
    with quiet_single_process():
        future = dcp.async_save(state, storage_writer=writer, planner=planner, process_group=step._checkpoint_group(),
                                no_dist=group is None)
    pending = PendingSave(future, finish, started)
    step._pending_save = pending
    return pending


def _metadata(step: "ParallelStep", model: torch.nn.Module, optimizer, world: int, updates: int, client_json: Any) -> dict:
    cfg = step.config
    zero = cfg.zero_optimization.stage
    meta: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "world_size": world,
        "zero_stage": zero if isinstance(zero, int) else 0,
        "precision": "fp16" if cfg.fp16.enabled is True else "bf16" if cfg.bf16.enabled is True else "fp32",
        "torch": torch.__version__, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "updates": updates, "micro_steps": step._micro_steps, "skipped_steps_seen": list(step._scale_seen),
        "model": {n: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
                  for n, p in _whole_shapes(step, model).items()},
        "client_state": client_json,
    }
    if optimizer is not None:
        tensors: dict[str, torch.Tensor] = {}
        meta["optimizer"] = {"type": type(optimizer).__name__,
                             "param_groups": encode_json(_param_groups(model, optimizer), "optimizer.param_groups", tensors, "x")}
    scheduler = step._lr_scheduler
    if scheduler is not None:
        tensors = {}
        meta["lr_scheduler"] = {"type": type(scheduler).__name__,
                                "state": encode_json(scheduler.state_dict(), "lr_scheduler.state_dict()", tensors, "x")}
        if tensors:
            raise CheckpointError("lr_scheduler.state_dict() holds tensors; stepfx saves scheduler state as JSON")
    config = getattr(model, "config", None)
    if config is not None and callable(getattr(config, "to_dict", None)) and type(model).__module__.startswith("transformers"):
        meta["hf_config"] = config.to_dict()
    return meta


def _whole_shapes(step: "ParallelStep", model: torch.nn.Module) -> dict[str, TensorSpec | torch.Tensor]:
    """Parameter and buffer name -> something with the whole ``shape`` and ``dtype``."""
    out: dict[str, Any] = {}
    held = step._store.held
    params = {id(p) for p in model.parameters()}
    for name, p in model.named_parameters():
        spec = held.get((Role.PARAM, name, None))
        out[name] = spec if isinstance(spec, TensorSpec) and p.numel() == 0 else p
    with reading_emptied():  # its buffers; an emptied module's parameters come from the pieces
        entries = model.state_dict(keep_vars=True)
    for key, b in entries.items():
        if id(b) not in params and isinstance(b, torch.Tensor):
            out[key] = b
    return out


# -- load ---------------------------------------------------------------------------
def resolve_checkpoint(directory: str, tag: str | None = None) -> str:
    """The directory of checkpoint ``tag`` (default: what ``latest`` names),
    checked to be complete."""
    directory = os.fspath(directory)
    if tag is None:
        latest = os.path.join(directory, LATEST)
        if not os.path.isfile(latest):
            raise CheckpointError(f"{directory}: no {LATEST!r} file; pass tag= to name a checkpoint")
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(directory, tag)
    if not os.path.isdir(path) and os.path.isdir(os.path.join(directory, f".{tag}.old")):
        path = os.path.join(directory, f".{tag}.old")  # a re-save of this tag was interrupted mid-swap
    for needed in (".metadata", META_FILE):
        if not os.path.isfile(os.path.join(path, needed)):
            raise CheckpointError(f"{path}: not a complete stepfx checkpoint (no {needed})")
    return path


def _read_meta(path: str) -> dict:
    with open(os.path.join(path, META_FILE)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
        raise CheckpointError(f"{path}: {META_FILE} is not a stepfx checkpoint of version <= {VERSION}")
    return meta


def load_checkpoint(step: "ParallelStep", directory: str, tag: str | None = None, *, model: torch.nn.Module | None = None,
                    optimizer: Any = None, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_rng_states: bool = True) -> tuple[str, dict]:
    """Load a checkpoint into the run: DeepSpeed's ``load_checkpoint``,
    returning ``(path, client_state)``. A collective. Before the step's
    first call, pass the ``model`` (and ``optimizer``, unless the config
    builds it). Each rank reads only what it holds now: its ZeRO pieces
    (whatever world size, stage or precision saved them) and whole tensors
    elsewhere."""
    step.wait_checkpoint()
    model = model if model is not None else step._model
    if model is None:
        raise CheckpointError(f"{step.__name__} has not been called yet: pass model= (and optimizer=) to load_checkpoint")
    if step._model is not None and model is not step._model:
        raise CheckpointError(f"{step.__name__} runs another model; load into the model it trains")
    optimizer = step._config_optimizer(model, optimizer) if step._model is None else step.optimizer
    rank, world, group = _world(step)
    if group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        group, rank = dist.group.WORLD, dist.get_rank()
    error: BaseException | None = None
    try:
        path = resolve_checkpoint(directory, tag)
        meta = _read_meta(path)
        index = read_index(path)
        plan = _load_plan(step, model, optimizer, meta, index, rank, load_optimizer_states=load_optimizer_states,
                          load_rng=load_rng_states)
        if plan.chunks:
            with quiet_single_process():
                dcp.load({}, storage_reader=SafeReader(path), planner=ChunkLoadPlanner(plan.chunks), no_dist=True)
    except BaseException as exc:  # noqa: BLE001 - reported on every rank below
        error = exc
    if group is not None:  # install only if every rank read everything
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, None if error is None else f"{type(error).__name__}: {error}", group=group)
        failed = [(r, e) for r, e in enumerate(everyone) if e is not None]
        if failed and error is None:
            raise CheckpointError(f"loading {directory} failed on rank {failed[0][0]}: {failed[0][1]}; nothing was loaded")
    if error is not None:
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(f"loading {directory}: {type(error).__name__}: {error}; nothing was loaded") from error
    _install(step, model, optimizer, plan, meta, rank, load_lr_scheduler_states=load_lr_scheduler_states)
    tensors = {fqn: t for fqn, t in plan.extra.items() if fqn.startswith("client/")}
    log.info("stepfx: %s: loaded %s (saved by %d ranks, ZeRO stage %s, %s)", step.__name__, path, meta["world_size"],
             meta["zero_stage"], meta["precision"])
    return path, decode_json(meta.get("client_state") or {"__dict__": []}, tensors)


@dataclass
class _LoadPlan:
    chunks: list[Chunk]
    installs: list[tuple[_Holding, torch.Tensor]]  # where each fresh tensor goes
    extra: dict[str, torch.Tensor]  # rng/ and client/ tensors read
    new_state: list[tuple[str, str, torch.Tensor]]  # optimizer state the run does not have yet (param, key, value)
    drop_state: list[str]  # parameters with optimizer state the checkpoint has none for


def _load_plan(step, model, optimizer, meta: dict, index, rank: int, *, load_optimizer_states: bool, load_rng: bool) -> _LoadPlan:
    saved = index.state_dict_metadata
    holdings = _holdings(step, model, optimizer, rank=rank)
    mine = {h.fqn for h in holdings}
    # the model: names and shapes must match (as load_state_dict(strict=True))
    whole = _whole_shapes(step, model)
    missing = [n for n in whole if f"model/{n}" not in saved]
    unexpected = [k.removeprefix("model/") for k in saved if k.startswith("model/") and k.removeprefix("model/") not in whole]
    if missing or unexpected:
        raise CheckpointError(f"the checkpoint's model does not match: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                              f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    for n, t in whole.items():
        md = saved[f"model/{n}"]
        if tuple(md.size) != tuple(t.shape):
            raise CheckpointError(f"model/{n}: the checkpoint has shape {tuple(md.size)}, the model {tuple(t.shape)}")
    if load_optimizer_states and optimizer is not None and "optimizer" in meta:
        if meta["optimizer"]["type"] != type(optimizer).__name__:
            raise CheckpointError(f"the checkpoint's optimizer is {meta['optimizer']['type']}, the run's "
                                  f"{type(optimizer).__name__}; pass load_optimizer_states=False to load the model only")
    chunks: list[Chunk] = []
    installs: list[tuple[_Holding, torch.Tensor]] = []
    for h in holdings:
        if h.fqn.startswith("optim/") and not load_optimizer_states:
            continue
        md = saved.get(h.fqn)
        if md is None:
            if h.fqn.startswith("runtime/"):
                continue  # e.g. an fp16 run resumed from bf16: the loss scaler starts afresh
            if h.fqn.startswith("optim/"):
                continue  # dropped below (no state for that parameter in the checkpoint)
            raise CheckpointError(f"{h.fqn}: not in the checkpoint")
        fresh = torch.empty_like(h.value)
        installs.append((h, fresh))
        chunks += h.chunks(fresh)
    new_state: list[tuple[str, str, torch.Tensor]] = []
    drop: list[str] = []
    if load_optimizer_states and optimizer is not None:
        params = dict(model.named_parameters())
        held_names = {n for (r, n, _k) in step._store.held if r is Role.OPTIMIZER_STATE}
        saved_state: dict[str, list[str]] = {}
        for fqn in saved:
            if fqn.startswith("optim/"):
                name, _, key = fqn.removeprefix("optim/").rpartition("/")
                saved_state.setdefault(name, []).append(key)
        for name, keys in saved_state.items():
            if name not in params:
                raise CheckpointError(f"optim/{name}: the checkpoint has optimizer state for a parameter the model lacks")
            if name in held_names:
                continue  # the rank's pieces (or another rank's): read above
            for key in keys:
                if f"optim/{name}/{key}" in mine:
                    continue
                md = saved[f"optim/{name}/{key}"]
                p = params[name]
                scalar = len(md.size) == 0
                device = p.device if not scalar or p.device.type == "cpu" or _state_on_device(optimizer) else torch.device("cpu")
                value = torch.empty(tuple(md.size), dtype=md.properties.dtype, device=device)
                new_state.append((name, key, value))
                chunks += chunks_of(f"optim/{name}/{key}", tuple(md.size), value, None)
        names = _param_names(model)
        drop = [names[id(p)] for p in optimizer.state if id(p) in names and names[id(p)] not in saved_state
                and optimizer.state[p]]
    if step.config.fp16.enabled is True:  # the loss scaler's state, for a run that has not made its own yet
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        for fqn, md in saved.items():
            if fqn.startswith("runtime/") and fqn not in mine:
                value = torch.empty(tuple(md.size), dtype=md.properties.dtype, device=device)
                ident = (Role.RUNTIME_STATE, fqn.removeprefix("runtime/"), None, None, Storage.RANK, None)
                installs.append((_Holding(fqn, tuple(md.size), value, None, ("store", ident)), value))
                chunks += chunks_of(fqn, tuple(md.size), value, None)
    extra: dict[str, torch.Tensor] = {}
    for fqn, md in saved.items():
        wanted = fqn.startswith("client/") or (load_rng and fqn.startswith(f"rng/{rank}/"))
        if wanted:
            extra[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            chunks += chunks_of(fqn, tuple(md.size), extra[fqn], None)
    if load_rng and not any(f.startswith(f"rng/{rank}/") for f in saved):
        log.warning("stepfx: rank %d: the checkpoint was saved by %d ranks and has no random number generator state "
                    "for this rank; its generators keep their state", rank, meta["world_size"])
    return _LoadPlan(chunks, installs, extra, new_state, drop)


def _state_on_device(optimizer) -> bool:
    """Whether the optimizer keeps its step counters on the parameters'
    device (torch's fused/capturable Adam) rather than on the CPU."""
    return any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)


def _install(step, model, optimizer, plan: _LoadPlan, meta: dict, rank: int, *, load_lr_scheduler_states: bool) -> None:
    """Everything read: put it where the run keeps it."""
    store = step._store
    params = dict(model.named_parameters())
    for h, value in plan.installs:
        kind = h.where[0]
        if kind == "store":
            old = store.tensors.get(h.where[1])
            if old is not None and old.shape == value.shape and old.untyped_storage().filename is not None:
                with torch.no_grad():
                    old.copy_(value)  # a file-backed value (offload_optimizer.device nvme) stays in its file
            else:
                store.tensors[h.where[1]] = value
        elif kind == "param":
            params[h.where[1]].data = value
        elif kind == "buffer":
            with torch.no_grad():
                h.value.copy_(value)  # buffers are often referenced by the module's code: keep the object
        elif kind == "optim":
            _, name, key = h.where
            optimizer.state[params[name]][key] = value
    for name, key, value in plan.new_state:
        optimizer.state[params[name]][key] = value
    for name in plan.drop_state:
        optimizer.state.pop(params[name], None)
    for copy in store.carried.values():
        copy.forget()  # compute copies: packed again from the loaded parameters
    for ident in list(store.carried):
        store.tensors.pop(ident, None)
    if optimizer is not None and "optimizer" in meta:
        groups = decode_json(meta["optimizer"]["param_groups"], {})
        if len(groups) != len(optimizer.param_groups):
            raise CheckpointError(f"the checkpoint's optimizer has {len(groups)} parameter groups, the run's {len(optimizer.param_groups)}")
        for saved, group in zip(groups, optimizer.param_groups):
            for k, v in saved.items():
                if k == "params" or k not in group:
                    continue
                if isinstance(group[k], torch.Tensor):
                    group[k].fill_(v)  # a tensor learning rate (capturable): the graph may read it in place
                else:
                    group[k] = v
    scheduler = step._lr_scheduler
    if load_lr_scheduler_states and "lr_scheduler" in meta:
        if scheduler is None:
            log.warning("stepfx: %s: the checkpoint has %s state and the run no scheduler; ignored", step.__name__,
                        meta["lr_scheduler"]["type"])
        else:
            scheduler.load_state_dict(decode_json(meta["lr_scheduler"]["state"], {}))
    step._micro_steps = int(meta.get("micro_steps", 0))
    step._scale_seen = tuple(meta.get("skipped_steps_seen", (0, 0)))
    step._scale_probe = None
    step._schedule_pending = False
    _set_rng(plan.extra, rank)

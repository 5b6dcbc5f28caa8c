"""Bind a step graph's slots to where their values live.

Slots with storage "user" live in the user's ``nn.Module`` and optimizer:
inputs are read from them before each run and outputs written back after
it, so ``model.state_dict()``, ``model.eval()`` and lr schedulers keep
working unchanged. Write-back keeps object identity: a parameter's new
value is installed with ``param.data = new`` (the optimizer keys its state
by the Parameter object, and users hold references to it); buffers
likewise; optimizer states are dict entries.

Slots with storage "rank" live in the :class:`RankStore` (ZeRO pieces, and
optimizer state the rank keeps instead of the user's optimizer). The first
read of such a slot takes its value from the user's object (the piece of a
parameter or of an optimizer state); once the step has run, the user's
copies are released (the optimizer's state entries dropped; the module's
parameters, under ZeRO-3, emptied — any use of them then fails loudly
instead of computing with stale values; ``step.sync_model()`` gathers them
back). A ZeRO-3 parameter whose one piece is the whole parameter (one rank)
goes earlier, as its piece is made, before the first run: on the device the
piece is the user's tensor itself, offloaded it is the host copy, so the
first run does not hold the model twice; a failed run puts it back.

Nothing is written anywhere until the whole graph has run, so a failed
step leaves the model, the optimizer and the rank's store as they were.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ..config.errors import ConfigError
from ..graph import (CARRIED_COPIES_KEY, HOST_PINNED_KEY, MASTER_COPIES_KEY, HOST_STATE_KEY, HOST_STATE_NVME_KEY, RUNTIME_INIT_KEY, Role,
                     StepSignature, Storage)
from ..graph.layout import LAYOUT_KEY, Sharding
from ..graph.signature import TensorSpec, hyperparam_tensor
from .carried import CarriedCopy, PieceCopy

__all__ = ["ModuleBinding", "RankStore"]


class RankStore:
    """Tensors this rank holds between steps, by slot identity, and what
    they stand for: ``held`` maps ``(role, name, key)`` of every tensor the
    user's objects no longer hold to its whole :class:`TensorSpec` (or, for
    whole scalars such as step counters, to the tensor itself), which is how
    later captures describe them."""

    def __init__(self):
        self.tensors: dict[tuple, torch.Tensor] = {}
        self.held: dict[tuple, Any] = {}
        self.carried: dict[tuple, CarriedCopy] = {}  # by slot identity: the carried compute copies' bookkeeping

    def __contains__(self, ident) -> bool:
        return ident in self.tensors

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def holds_user_state(self) -> bool:
        """Whether it holds state of the user's objects (ZeRO pieces, the
        loss scaler's), not only compute copies it can make again."""
        return any(ident not in self.carried for ident in self.tensors)

    def drop_carried(self) -> None:
        """Forget the compute copies (they are of another model's parameters)."""
        for ident in self.carried:
            self.tensors.pop(ident, None)
        self.carried.clear()


def _file_backed(value: torch.Tensor, directory: str, role: Role) -> torch.Tensor:
    """``value`` in a mapped file under ``directory`` (``offload_optimizer`` / ``offload_param`` with
    ``device: nvme``): the page cache keeps what fits in memory, the drive the rest. The file is unlinked
    once mapped, so nothing is left behind when the process ends, however it ends."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=f"stepfx-{os.getpid()}-", suffix=".state", dir=directory)
    except OSError as exc:
        block, what = ("offload_param", "parameters") if role is Role.PARAM else ("offload_optimizer", "optimizer state")
        raise ConfigError(f"zero_optimization.{block}.nvme_path", f"cannot keep {what} there: {exc}",
                          value=directory, expected="a directory this process may write") from exc
    os.close(fd)
    try:
        mapped = torch.from_file(path, shared=True, size=value.numel(), dtype=value.dtype).view(value.shape)
    finally:
        os.unlink(path)
    mapped.copy_(value)
    return mapped


def _is_carried(slot, carried: dict) -> bool:
    return slot.role is Role.RUNTIME_STATE and slot.storage is Storage.RANK and slot.key in carried


def _owner(model: torch.nn.Module, name: str):
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    return module, attr


class ModuleBinding:
    """Reads graph inputs from, and writes outputs to, the user's module and
    optimizer and this rank's store."""

    def __init__(
        self,
        signature: StepSignature,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        store: RankStore | None = None,
    ):
        self.signature = signature
        self.model = model
        self.optimizer = optimizer
        self.store = store if store is not None else RankStore()
        params = dict(model.named_parameters())
        self._params = params
        # the compute copies this plan carries (plans with the same layout share one)
        carried = signature.extra.get(CARRIED_COPIES_KEY, {})
        masters = signature.extra.get(MASTER_COPIES_KEY, {})
        self._position = {s.ident: i for i, s in enumerate(signature.inputs)}
        self._carried = {}
        for s in signature.inputs:
            if _is_carried(s, carried):
                if s.ident not in self.store.carried:
                    layout = carried[s.key]
                    self.store.carried[s.ident] = CarriedCopy(layout, [params[n] for n in layout.names])
                self._carried[s.ident] = self.store.carried[s.ident]
            elif s.ident in masters:  # host_master_weights: the device copy of a host-held piece
                if not isinstance(self.store.carried.get(s.ident), PieceCopy):
                    piece, dtype, delayed = masters[s.ident]
                    self.store.carried[s.ident] = PieceCopy(dtype, params[s.name].device, self._master_reader(piece),
                                                            delayed)
                self._carried[s.ident] = self.store.carried[s.ident]
        # offload_optimizer: rank-held slots whose values live on the host
        self._host_state = frozenset(signature.extra.get(HOST_STATE_KEY, ()))
        # offload_param with pin_memory: host-held pieces the device copies up from while it computes
        self._pinned = frozenset(signature.extra.get(HOST_PINNED_KEY, ())) if torch.cuda.is_available() else frozenset()
        grads_out = {s.name for s in signature.outputs if s.role is Role.GRAD}
        # a gradient that existed before the step and is not returned was
        # cleared by the step (zero_grad(set_to_none=True))
        self._grads_cleared = [params[s.name] for s in signature.inputs if s.role is Role.GRAD and s.name not in grads_out]
        layout = signature.extra.get(LAYOUT_KEY)
        sharded = [(b, p) for b, p in layout.params() if b.sharding is not Sharding.NONE] if layout else []
        # the rank keeps all optimizer state of these (the state the step reads: a frozen parameter's, which
        # Adagrad makes at construction, stays in the user's optimizer); under ZeRO-3 their values too
        read_state = {s.name for s in signature.inputs if s.role is Role.OPTIMIZER_STATE}
        self._state_owned = [params[p.name] for b, p in sharded if b.shards_state and p.name in read_state]
        self._params_owned = [params[p.name] for b, p in sharded if b.sharding is Sharding.PARAMETERS]
        self._whole_scalars = {(s.role, s.name, s.key): s.ident for s in (*signature.inputs, *signature.outputs)
                               if s.storage is Storage.RANK and s.piece is None and s.split is None
                               and s.ident not in self._carried}
        # tensor parallelism: gradients accumulated as this rank's shards, described whole after the run
        # that writes them (the next micro-step's capture reads them as held; the update consumes them)
        self._split_grads = {(s.role, s.name, s.key): (s.ident, s.split) for s in signature.outputs
                             if s.role is Role.GRAD and s.storage is Storage.RANK and s.split is not None}
        # tensor parallelism: the rank holds its shard of these parameters and all their optimizer state
        tp_split = [params[s.name] for s in signature.inputs if s.role is Role.PARAM and s.split is not None]
        self._state_owned += tp_split
        self._params_owned += tp_split
        # the parameters the step writes: their versions are bumped after it, as optimizer.step() does
        self._stepped_params = [params[s.name] for s in signature.outputs if s.role is Role.PARAM and s.storage is Storage.USER]
        # rank-held gradients an update consumes (read, not written back)
        out_idents = {s.ident for s in signature.outputs}
        self._consumed = [s for s in signature.inputs if s.storage is Storage.RANK and s.role is Role.GRAD and s.ident not in out_idents]
        self._early = self._early_releases(signature, params, carried)
        self._releasing = False  # inputs() of a run (not of a read-only binding): the user's copies may go early
        self._restore: dict[str, Callable[[], torch.Tensor]] = {}  # released early: how to put each back
        self._readers: list[Callable[[], Any] | None] = []
        self._batch_positions: list[int] = []
        for i, slot in enumerate(signature.inputs):
            self._readers.append(self._reader(slot, params))
            if slot.role is Role.BATCH:
                self._batch_positions.append(i)
        self._writers = [self._writer(slot, params) for slot in signature.outputs]

    def _early_releases(self, signature, params, carried) -> frozenset:
        """The ZeRO-3 parameters whose user copy may go as soon as this rank's piece of it is made, before the
        first run: those whose one piece is the whole parameter (one rank, no tensor-parallel split) and that no
        other input reads from the user's module. Otherwise the first run would hold the user's copy and the
        piece together (at one rank, a 13B model's fp32 parameters twice: 48 GiB more than the steady state)."""
        owned = {id(p) for p in self._params_owned}
        readers: dict[str, int] = {}  # name -> inputs reading the user's parameter (a device copy of a piece reads the piece)
        for s in signature.inputs:
            if s.role is Role.PARAM and s.ident not in self._carried:
                readers[s.name] = readers.get(s.name, 0) + 1
        for layout in carried.values():
            for name in layout.names:
                readers[name] = readers.get(name, 0) + 1
        whole = set()
        for s in signature.inputs:
            if (s.role is Role.PARAM and s.storage is Storage.RANK and id(params[s.name]) in owned and s.split is None
                    and readers.get(s.name) == 1 and s.ident not in self._carried
                    and (s.piece is None or (s.piece[0] == 0 and s.piece[1] == params[s.name].numel()))):
                whole.add(s.ident)
        return frozenset(whole)

    # -- inputs ---------------------------------------------------------------
    def _master_reader(self, ident) -> Callable[[], torch.Tensor]:
        """The reader of the host-held piece ``ident`` (made once the readers exist)."""
        at = self._position[ident]
        return lambda: self._readers[at]()

    def _user_tensor(self, slot, params) -> Callable[[], torch.Tensor]:
        """Where a rank-held slot's first value comes from."""
        if slot.role is Role.PARAM:
            p = params[slot.name]
            return lambda: p
        if slot.role is Role.OPTIMIZER_STATE:
            p, opt, key, held = params[slot.name], self.optimizer, slot.key, self.store.held

            def user_state():
                state = opt.state.get(p)
                if state is not None and key in state:
                    return state[key]
                # created for the rank before the first capture (capture/initial_state.py):
                # zeros (a TensorSpec: the caller makes only its piece), or the step counter itself
                initial = held.get((slot.role, slot.name, key))
                if initial is None:
                    raise ValueError(f"no optimizer state {key!r} for {slot.name}: the rank holds none and the optimizer neither")
                return initial

            return user_state
        if slot.role is Role.GRAD:
            p = params[slot.name]

            def user_grad():
                if p.grad is None:
                    raise ValueError(f"no accumulated gradient for {slot.name}: the rank holds none and .grad is None")
                return p.grad

            return user_grad
        if slot.role is Role.RUNTIME_STATE:
            value, dtype = self.signature.extra.get(RUNTIME_INIT_KEY, {}).get(slot.name, (None, None))
            if value is None:
                raise ValueError(f"no initial value for stepfx runtime state {slot.name!r}")
            device = next(iter(params.values())).device if params else torch.device("cpu")
            return lambda: torch.full((), value, dtype=dtype, device=device)
        raise ValueError(f"cannot bind {slot.describe()}")

    def _reader(self, slot, params):
        role = slot.role
        if slot.ident in self._carried:
            store, ident, kept = self.store, slot.ident, self._carried[slot.ident]

            def read_carried():
                store.carried.setdefault(ident, kept)  # again, if a switch of models dropped it
                for other_ident, other in store.carried.items():  # one kept copy of a parameter at a time
                    if other is not kept and other.overlaps(kept) and store.tensors.pop(other_ident, None) is not None:
                        other.forget()
                value = kept.read(store.tensors.get(ident))
                store.tensors[ident] = value
                return value

            return read_carried
        if slot.storage is Storage.RANK:
            source = self._user_tensor(slot, params)
            store, ident, piece, split = self.store, slot.ident, slot.piece, slot.split
            on_host = slot.ident in self._host_state
            pinned = slot.ident in self._pinned
            early = slot.ident in self._early
            nvme = self.signature.extra.get(HOST_STATE_NVME_KEY)

            def read_rank():
                value = store.tensors.get(ident)
                if value is None:
                    whole = source()
                    # a tensor-parallel shard is cut first (``split``), then its ZeRO piece (``piece``)
                    if isinstance(whole, TensorSpec):  # zeros never made whole
                        shape = (piece[1] - piece[0],) if piece is not None else \
                            split.local_shape(whole.shape) if split is not None else whole.shape
                        value = torch.zeros(shape, dtype=whole.dtype, device="cpu" if on_host else whole.device)
                    else:
                        whole = split.take(whole.detach()) if split is not None else whole.detach()
                        value = whole.reshape(-1)[piece[0] : piece[1]] if piece is not None else whole
                        # released early on the device: the piece is the user's whole tensor (its storage kept);
                        # offload_optimizer: state the host keeps between steps moves there on first read
                        if not (early and self._releasing and not on_host and not pinned):
                            value = value.to("cpu", copy=True) if on_host else value.clone()
                    if on_host and nvme is not None:
                        value = _file_backed(value, nvme, slot.role)
                    elif pinned and not value.is_pinned():
                        value = value.pin_memory()
                    store.tensors[ident] = value
                    if early and self._releasing and isinstance(whole, torch.Tensor):
                        self._release_early(slot.name, value)
                return value

            return read_rank
        if role is Role.PARAM:
            p = params[slot.name]
            return lambda: p
        if role is Role.BUFFER:
            module, attr = _owner(self.model, slot.name)
            return lambda: module._buffers[attr]
        if role is Role.GRAD:
            p = params[slot.name]
            return lambda: p.grad
        if role is Role.OPTIMIZER_STATE:
            p, opt, key = params[slot.name], self.optimizer, slot.key
            return lambda: opt.state[p][key]
        if role is Role.HYPERPARAM:
            group = self.optimizer.param_groups[slot.group]
            if slot.name in ("beta1", "beta2"):
                i = 0 if slot.name == "beta1" else 1
                return lambda: hyperparam_tensor(group["betas"][i])
            name = slot.name
            return lambda: hyperparam_tensor(group[name])
        if role is Role.BATCH:
            return None
        raise ValueError(f"cannot bind input {slot.describe()} to a module")

    def _release_early(self, name: str, piece: torch.Tensor) -> None:
        """The user's ``name`` goes now that its piece (the whole parameter) exists; a failed run puts it back."""
        p = self._params[name]
        shape, device = p.shape, p.device
        self._restore[name] = lambda: (piece if piece.device == device else piece.to(device)).view(shape)
        p.data = torch.empty(0, dtype=p.dtype, device=device)

    def inputs(self, batch_tensors: list[torch.Tensor], *, release: bool = False) -> list[Any]:
        """The graph's inputs. ``release``: this is a run's read (not a read-only look), so the ZeRO-3
        parameters whose piece is the whole parameter leave the user's module as their pieces are made
        (:meth:`failed` puts them back)."""
        self._releasing = release
        try:
            values = [r() if r is not None else None for r in self._readers]
        finally:
            self._releasing = False
        for pos, t in zip(self._batch_positions, batch_tensors):
            values[pos] = t
        return values

    # -- outputs --------------------------------------------------------------
    def _writer(self, slot, params):
        role = slot.role
        if slot.storage is Storage.RANK:
            store, ident = self.store, slot.ident

            def write_rank(v):
                store.tensors[ident] = v

            return write_rank
        if role is Role.PARAM:
            p = params[slot.name]

            def write_param(v):
                if v is not p:
                    p.data = v

            return write_param
        if role is Role.BUFFER:
            module, attr = _owner(self.model, slot.name)

            def write_buffer(v):
                old = module._buffers[attr]
                if v is old:
                    return
                if old is not None and old.shape == v.shape and old.dtype == v.dtype:
                    old.data = v
                else:
                    module._buffers[attr] = v

            return write_buffer
        if role is Role.GRAD:
            p = params[slot.name]

            def write_grad(v):
                p.grad = v

            return write_grad
        if role is Role.OPTIMIZER_STATE:
            p, opt, key = params[slot.name], self.optimizer, slot.key

            def write_state(v):
                opt.state[p][key] = v

            return write_state
        if role is Role.USER_OUTPUT:
            return None
        raise ValueError(f"cannot write output {slot.describe()} to a module")

    def write(self, outputs) -> Any:
        """Install new state and return the user's result."""
        user_leaves = []
        for writer, value in zip(self._writers, outputs):
            if writer is None:
                user_leaves.append(value)
            else:
                writer(value)
        for p in self._grads_cleared:
            p.grad = None
        self._restore.clear()
        self._release_user_copies()
        if self._stepped_params:
            torch.autograd.graph.increment_version(self._stepped_params)
        for c in self._carried.values():
            c.stepped()
        return self.user_result(user_leaves)

    def failed(self) -> None:
        """The step failed: carried copies are packed afresh next time; parameters released early are the
        user's again."""
        for c in self._carried.values():
            c.forget()
        for name, restore in self._restore.items():
            self._params[name].data = restore()
        self._restore.clear()

    def carried_notes(self) -> list[str]:
        """What explain() says of the compute copies this plan carries."""
        return [c.describe() for c in self._carried.values()]

    def _release_user_copies(self) -> None:
        """The rank now holds these; the user's objects must not keep stale
        copies (and the memory is the point of ZeRO)."""
        opt = self.optimizer
        if opt is not None:
            for p in self._state_owned:
                opt.state.pop(p, None)
        for p in self._params_owned:
            if p.numel() > 0:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for slot in self._consumed:
            self.store.tensors.pop(slot.ident, None)
            self.store.held.pop((slot.role, slot.name, slot.key), None)
        for key, ident in self._whole_scalars.items():
            if ident in self.store.tensors:
                self.store.held[key] = self.store.tensors[ident]
        for key, (ident, split) in self._split_grads.items():
            shard = self.store.tensors.get(ident)
            if shard is not None:
                shape = tuple(n * split.count if d == split.dim else n for d, n in enumerate(shard.shape))
                self.store.held[key] = TensorSpec(shape, shard.dtype, shard.device)

    def user_result(self, slot_leaves: list) -> Any:
        sig = self.signature
        if sig.user_output_spec is None:
            return None
        it = iter(slot_leaves)
        leaves = [next(it) if from_slot else const for from_slot, const in zip(sig.user_output_from_slot, sig.user_output_constants)]
        return pytree.tree_unflatten(leaves, sig.user_output_spec)

"""Bind a step graph's slots to the user's live objects.

While nothing is sharded, the user's ``nn.Module`` and optimizer *are* the
persistent state: inputs are read from them before each run and outputs are
written back after it, so ``model.state_dict()``, ``model.eval()`` and lr
schedulers keep working unchanged.

Write-back keeps object identity: a parameter's new value is installed with
``param.data = new`` (the optimizer keys its state by the Parameter object,
and users hold references to it); buffers likewise; optimizer states are
dict entries. Nothing is written until the whole graph has run, so a failed
step leaves the model and optimizer as they were.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ..graph import Role, StepSignature
from ..graph.signature import hyperparam_tensor

__all__ = ["ModuleBinding"]


class ModuleBinding:
    """Reads graph inputs from and writes outputs to a module + optimizer."""

    def __init__(self, signature: StepSignature, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
        self.signature = signature
        self.model = model
        self.optimizer = optimizer
        params = dict(model.named_parameters())
        self._params = params
        self._readers: list[Callable[[], Any] | None] = []
        self._batch_positions: list[int] = []
        for i, slot in enumerate(signature.inputs):
            self._readers.append(self._reader(slot, params))
            if slot.role is Role.BATCH:
                self._batch_positions.append(i)
        self._writers = [self._writer(slot, params) for slot in signature.outputs]
        grads_out = {s.name for s in signature.outputs if s.role is Role.GRAD}
        # a gradient that existed before the step and is not returned was
        # cleared by the step (zero_grad(set_to_none=True))
        self._grads_cleared = [params[s.name] for s in signature.inputs if s.role is Role.GRAD and s.name not in grads_out]

    # -- inputs ---------------------------------------------------------------
    def _reader(self, slot, params):
        role = slot.role
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
            name = slot.name
            return lambda: hyperparam_tensor(group[name])
        if role is Role.BATCH:
            return None
        raise ValueError(f"cannot bind input {slot.describe()} to a module")

    def inputs(self, batch_tensors: list[torch.Tensor]) -> list[Any]:
        values = [r() if r is not None else None for r in self._readers]
        for pos, t in zip(self._batch_positions, batch_tensors):
            values[pos] = t
        return values

    # -- outputs --------------------------------------------------------------
    def _writer(self, slot, params):
        role = slot.role
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
        return self.user_result(user_leaves)

    def user_result(self, slot_leaves: list) -> Any:
        sig = self.signature
        if sig.user_output_spec is None:
            return None
        it = iter(slot_leaves)
        leaves = [next(it) if from_slot else const for from_slot, const in zip(sig.user_output_from_slot, sig.user_output_constants)]
        return pytree.tree_unflatten(leaves, sig.user_output_spec)


def _owner(model: torch.nn.Module, name: str):
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    return module, attr

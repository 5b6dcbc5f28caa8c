"""Symbolic batch sizes: which dimensions are symbolic, and when a captured
step fits a call.

A batch tensor's dimension named in ``dims`` enters the trace as a SymInt of
the fake mode's ShapeEnv (sympy expressions, as torch's symbolic shapes give
them); parameters, buffers and optimizer state always stay static. While the
step is traced (and while passes re-trace it), every decision Python code
makes on a symbolic size becomes a *guard* in that ShapeEnv: an equality
(``s0 == s1``: labels as long as the inputs), a specialization (``s0 == 16``)
or a range (sizes 0 and 1 are specialized, symbolic sizes are >= 2).
:class:`BatchShapeGuard` turns those into one expression over a call's batch
tensors: the captured step fits the call exactly when it holds.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch

from .. import compat

__all__ = ["BatchShapeGuard", "DYNAMIC_KEY", "changed_dims", "symbolic_sizes"]

DYNAMIC_KEY = "dynamic_dims"  # signature.extra: batch slot name -> the dims captured as symbolic


def changed_dims(old: Sequence[int], new: Sequence[int]) -> frozenset[int]:
    """The dimensions whose size differs between two shapes of one rank."""
    if len(old) != len(new):
        return frozenset()
    return frozenset(i for i, (a, b) in enumerate(zip(old, new)) if a != b)


def symbolic_sizes(value) -> list[tuple[int, str]]:
    """``(dim, expression)`` of every symbolic dimension of a fake tensor."""
    if not isinstance(value, torch.Tensor):
        return []
    return [(i, str(s)) for i, s in enumerate(value.shape) if compat.is_symbolic(s)]


@dataclasses.dataclass
class BatchShapeGuard:
    """When a step captured with symbolic batch sizes fits a call.

    ``names``: the batch slots in graph order; ``sizes``: per slot, its
    symbolic dimensions as ``(dim, expression)``; ``guards``: what the trace
    assumed of them, each with torch's note of where (the user's line when
    torch kept it)."""

    names: tuple[str, ...]
    sizes: tuple[tuple[tuple[int, str], ...], ...]
    guards: tuple[tuple[str, str | None], ...]
    _shape_env: object = dataclasses.field(repr=False, default=None)
    _code: str | None = dataclasses.field(repr=False, default=None)

    @classmethod
    def of(cls, batch: Mapping[str, torch.Tensor]) -> "BatchShapeGuard | None":
        """The guard of a traced step from its batch placeholders' fake
        values (by slot name); None when no batch size is symbolic."""
        names = tuple(batch)
        sizes = tuple(tuple(symbolic_sizes(v)) for v in batch.values())
        if not any(sizes):
            return None
        fakes = list(batch.values())
        env = compat.shape_env_of(next(v for v, s in zip(fakes, sizes) if s).fake_mode)
        code = compat.guard_code(env, fakes)
        guards = tuple(compat.recorded_guards(env))
        return cls(names, sizes, guards, env, code)

    @staticmethod
    def specialized(batch: Mapping[str, torch.Tensor]) -> list[tuple[str, str | None]]:
        """The guards of a trace whose symbolic batch sizes all became
        constants (``s0 == 33``), with where each was made: why a step asked
        to serve every size serves one."""
        fakes = [v for v in batch.values() if isinstance(v, torch.Tensor) and compat.is_fake(v)]
        env = compat.shape_env_of(fakes[0].fake_mode) if fakes else None
        return compat.recorded_guards(env) if env is not None else []

    def check(self, batch: Sequence[torch.Tensor]) -> bool:
        """Whether the captured step computes this call's batch (the
        tensors in the order of ``names``)."""
        if self._code is None:
            return True
        return compat.evaluate_guard_code(self._shape_env, self._code, batch)

    def describe(self) -> list[str]:
        """Lines for ``explain()``: the symbolic sizes and the guards."""
        lines = []
        for name, sizes in zip(self.names, self.sizes):
            if sizes:
                lines.append(f"  batch {name}: " + ", ".join(f"dim {d} = {e}" for d, e in sizes))
        if self.guards:
            lines.append("  guards (a call that breaks one is captured again for its sizes):")
            for expr, where in self.guards:
                lines.append(f"    {expr}" + (f"    ({where})" if where else ""))
        else:
            lines.append("  no guards: any sizes of the symbolic dimensions run this variant")
        return lines

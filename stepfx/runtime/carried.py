"""The parameters' 16-bit compute copies, kept from one step to the next.

``carry_parameter_copies`` makes the step read its bf16/fp16 copies of the
parameters from a buffer the rank keeps, and the optimizer kernel write the
updated parameters' copies into it; without this, every step begins by
reading all fp32 parameters to round them again (5.2 GB on the 1.3B GPT).
The buffer is only right while nothing but the step changed the
parameters, so before each step :class:`CarriedCopy` compares a token of
each parameter with the one taken after the last step, and packs the copies
afresh from the parameters when any differs. What the token sees:

- writes through the parameter or any ``detach()`` of it (``p.mul_()`` under
  ``no_grad``, ``load_state_dict``, ``torch.nn.init``): they bump the
  tensor's version counter;
- a new tensor put in its place (``p.data = t``, ``module.to()``): its
  address changes;
- writes through ``p.data``, which makes a tensor with a version counter of
  its own (torch's rule): a carried parameter is made a
  :class:`WatchedParameter`, an ``nn.Parameter`` whose ``data`` attribute
  counts its uses. Any use of a carried parameter's ``.data``, read or
  write, makes its copies pack afresh before the next step, so a loop
  that reads ``p.data`` each step costs the pack it would have saved
  (``CarriedCopy.repacks`` counts them; explain() shows it).
- stepfx's own in-place updates: after a step the binding bumps the version
  of each parameter the step wrote (as ``optimizer.step()`` does), so a
  carried copy of another plan or another decorated step sees them.

Not seen: writes that bypass torch's version counters (a raw pointer from
``data_ptr()``, a DLPack export, and c10d's in-place collectives such as
``dist.broadcast(p)``, measured: none bumps it; hence the pass carries only
on one rank, where collectives on parameters have no use). Parameters of
another ``nn.Parameter`` subclass keep their class: their copies are packed
every step, as without this.
"""
from __future__ import annotations

import copy

import torch

from ..graph import CarriedCopies

__all__ = ["CarriedCopy", "PieceCopy", "WatchedParameter", "watch"]

class WatchedParameter(torch.nn.Parameter):
    """An ``nn.Parameter`` whose ``.data`` (get or set) is counted in
    ``data_uses``: see the module docstring. Everything else is
    ``nn.Parameter``'s; it pickles and deep-copies as a plain
    ``nn.Parameter`` (without the count)."""

    data_uses = 0  # per parameter once counted (an instance attribute)

    @property
    def data(self):
        self.data_uses += 1
        return torch.nn.Parameter.data.__get__(self)

    @data.setter
    def data(self, value):
        self.data_uses += 1
        torch.nn.Parameter.data.__set__(self, value)

    def _plain(self) -> torch.nn.Parameter:
        """A plain ``nn.Parameter`` on the same storage, with the same attributes but the count."""
        plain = torch.nn.Parameter(torch.nn.Parameter.data.__get__(self), self.requires_grad)
        plain.__dict__.update({k: v for k, v in self.__dict__.items() if k != "data_uses"})
        return plain

    def __reduce_ex__(self, proto):
        return self._plain().__reduce_ex__(proto)

    def __repr__(self) -> str:
        shown = torch.nn.Parameter.data.__get__(self).requires_grad_(self.requires_grad)
        return "Parameter containing:\n" + repr(shown)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        result = copy.deepcopy(self._plain(), memo)
        memo[id(self)] = result
        return result


def watch(p: torch.nn.Parameter) -> bool:
    """Make ``p`` a :class:`WatchedParameter` (same object, class swapped,
    as ``torch.nn.utils.parametrize`` swaps a module's); False when ``p``
    is of another subclass, which is left as it is."""
    if type(p) is torch.nn.Parameter:
        p.__class__ = WatchedParameter
    return type(p) is WatchedParameter


class CarriedCopy:
    """One carried buffer of a plan: the parameters it copies, the token
    taken after the last step that left it right, and how often it was
    packed afresh."""

    def __init__(self, layout: CarriedCopies, params: list[torch.nn.Parameter]):
        self.layout = layout
        self.params = params
        self.watched = all(watch(p) for p in params)
        self.token: tuple | None = None
        self.repacks = 0
        self.reads = 0
        self._ids = frozenset(id(p) for p in params)

    def overlaps(self, other: "CarriedCopy") -> bool:
        """Whether the two copy some parameter in common (another plan's
        layout of the same model): the rank keeps one of them at a time."""
        return not self._ids.isdisjoint(other._ids)

    def _token(self) -> tuple | None:
        if not self.watched:
            return None
        ps = self.params
        return [p._version for p in ps], [p.data_ptr() for p in ps], [p.data_uses for p in ps]

    def read(self, held: torch.Tensor | None) -> torch.Tensor:
        """The copies for this step: ``held`` when still right, else packed
        afresh from the parameters (into ``held``, keeping its address)."""
        from ..codegen import graph_ops

        self.reads += 1
        token = self._token()
        if held is not None and token is not None and token == self.token:
            return held
        self.repacks += 1
        lay = self.layout
        return graph_ops.pack([p.detach() for p in self.params], list(lay.offsets), lay.total, dtype=lay.dtype,
                              out=held)

    def stepped(self) -> None:
        """The step ran: the buffer holds the copies of the parameters as they are now."""
        self.token = self._token()

    def forget(self) -> None:
        """The step failed: pack afresh next time."""
        self.token = None

    def describe(self) -> str:
        lay = self.layout
        size = lay.total * lay.dtype.itemsize / 2**20
        text = f"{len(lay.names)} parameters' {str(lay.dtype).removeprefix('torch.')} copies ({size:.1f} MiB)"
        if not self.watched:
            return text + ": packed every step (a parameter is an nn.Parameter subclass stepfx does not watch)"
        return text + f": packed afresh at {self.repacks} of {self.reads} steps"


class PieceCopy:
    """The 16-bit device copy of a rank-held parameter piece whose fp32 master
    lives on the host (``host_master_weights``): the host update makes the
    next one each step; it is made afresh from the master when the master
    changed otherwise (a checkpoint loaded, a reshard: its version counter or
    address moved since the last step), as :class:`CarriedCopy` does for whole
    parameters. ``source`` reads the master (the binding's reader of it)."""

    _ids: frozenset = frozenset()  # copies no user parameter (CarriedCopy.overlaps reads this)

    def __init__(self, dtype: torch.dtype, device: torch.device, source, delayed: bool = False):
        self.dtype, self.device, self.source = dtype, device, source
        # delayed_parameter_update: a host update may be running on the master between steps (its version moves
        # under it), and the copy the step left is the one to read; made afresh only when forgotten (a failed
        # step, a loaded checkpoint), when nothing runs on the master
        self.delayed = delayed
        self.token: tuple | None = None
        self.repacks = 0
        self.reads = 0

    def overlaps(self, other) -> bool:
        return False

    def _token(self) -> tuple:
        master = self.source()
        return master._version, master.data_ptr()

    def read(self, held: torch.Tensor | None) -> torch.Tensor:
        self.reads += 1
        if held is not None and self.token is not None and (self.delayed or self._token() == self.token):
            return held
        self.repacks += 1
        return self.source().detach().to(device=self.device, dtype=self.dtype, copy=True)

    def stepped(self) -> None:
        self.token = () if self.delayed else self._token()

    def forget(self) -> None:
        self.token = None

    def describe(self) -> str:
        return f"a piece's {str(self.dtype).removeprefix('torch.')} copy: made afresh at {self.repacks} of {self.reads} steps"

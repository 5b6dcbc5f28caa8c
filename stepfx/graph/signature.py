"""The step signature: what every input and output of a step graph *is*.

A captured step is a pure function ``(state, batch) -> (new state, user
outputs)``. The signature names each positional input and each output with a
:class:`Slot`: its role (a parameter, an optimizer state, a batch tensor, ...)
and the name that binds it to live objects (``"fc1.weight"``,
``"fc1.weight"/"exp_avg"``, ``group 0 / "lr"``). Passes rewrite roles (ZeRO
turns a parameter into a parameter shard); the runtime binds slots to storage.

Invariants (checked by :func:`stepfx.graph.verify.verify_step_graph`):
- the graph's placeholders are the signature's inputs, in order, and each
  placeholder carries its slot in ``node.meta["slot"]``;
- the graph returns one flat tuple whose entries are the signature's outputs;
- (role, name, key) identifies a slot uniquely among the inputs and among the
  outputs; an output whose identity equals an input's *updates* that input.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils._pytree import TreeSpec

__all__ = ["Role", "Storage", "Slot", "StepSignature", "STATE_ROLES", "RUNTIME_INIT_KEY", "CARRIED_COPIES_KEY", "HOST_STATE_KEY", "HOST_STATE_NVME_KEY", "HOST_PINNED_KEY", "MASTER_COPIES_KEY",
           "CarriedCopies", "TensorSpec", "hyperparam_tensor"]


class Role(str, enum.Enum):
    """What a graph input or output stands for."""

    PARAM = "param"  # a model parameter (whole); updated by the optimizer
    BUFFER = "buffer"  # a model buffer (BatchNorm running stats, ...)
    GRAD = "grad"  # a parameter's .grad that exists before or after the step
    OPTIMIZER_STATE = "optimizer_state"  # exp_avg, exp_avg_sq, step, momentum_buffer, ...
    HYPERPARAM = "hyperparam"  # a per-group scalar read every step (the learning rate)
    BATCH = "batch"  # a tensor leaf of the step's positional/keyword arguments
    RUNTIME_STATE = "runtime_state"  # stepfx's own state across steps (the fp16 loss scale and its counters)
    USER_OUTPUT = "user_output"  # a leaf of what the user's step returns

    def __str__(self) -> str:  # keeps f-strings and explain() readable
        return self.value


# Roles whose values persist across steps.
STATE_ROLES = frozenset({Role.PARAM, Role.BUFFER, Role.GRAD, Role.OPTIMIZER_STATE, Role.RUNTIME_STATE})

# StepSignature.extra key: initial values of RUNTIME_STATE slots,
# ``{name: (python value, torch dtype)}``, made on the parameters' device.
RUNTIME_INIT_KEY = "runtime_init"
# StepSignature.extra key: RUNTIME_STATE slots that hold the parameters'
# 16-bit compute copies across steps, ``{slot key: CarriedCopies}``
# (``carry_parameter_copies``).
CARRIED_COPIES_KEY = "carried_copies"
HOST_STATE_KEY = "host_state"  # extra: idents of rank-held slots whose values live on the host (offload_optimizer)
HOST_STATE_NVME_KEY = "host_state_nvme"  # extra: the directory whose files back those values (device "nvme")
HOST_PINNED_KEY = "host_pinned"  # extra: those the binding keeps in pinned memory (offload_param's pin_memory)
# extra: {ident of a RUNTIME_STATE slot: (ident of the host-held parameter piece it is the copy of, the copy's dtype)}
# (host_master_weights: the device keeps the copy between steps, the host the fp32 master)
MASTER_COPIES_KEY = "master_copies"
# StepSignature.extra key: True when the graph reads one optimizer step
# counter for all parameters (they were all equal at capture, and the
# fingerprint keeps them so): any counter the rank holds may stand for it.
SHARED_STEP_KEY = "shared_step"


@dataclass(frozen=True)
class CarriedCopies:
    """A flat ``total``-element buffer of ``dtype`` holding parameter
    ``names[i]`` rounded at ``offsets[i]`` (zeros between): what
    ``graph_ops.pack`` makes of them, kept from one step to the next."""

    names: tuple[str, ...]
    offsets: tuple[int, ...]
    total: int
    dtype: Any


class Storage(str, enum.Enum):
    """Where a state slot's value lives between steps."""

    USER = "user"  # in the user's module / optimizer (read before, written after each step)
    RANK = "rank"  # held by this rank's executor (shards, and state the user's objects no longer hold)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Slot:
    """One input or output of a step graph.

    ``name`` binds the slot: a parameter/buffer fully qualified name for
    PARAM, BUFFER, GRAD and OPTIMIZER_STATE (the owning parameter), ``"lr"``
    style names for HYPERPARAM, the pytree path (``"[0]['x']"``) for BATCH
    and USER_OUTPUT. ``key`` distinguishes several optimizer states of one
    parameter; ``group`` is the optimizer param-group index for HYPERPARAM.
    ``storage`` says who holds the value between steps; ``piece`` is the
    flat element range ``[start, stop)`` of the named tensor that this slot
    holds when the tensor is sharded (ZeRO), None when it holds all of it.
    ``split`` (a ``tp_layout.TensorSplit``) is the Megatron shard a rank holds
    under tensor parallelism (storage "rank"); it is not part of ``ident``:
    a tensor has one tensor-parallel placement per plan.
    """

    role: Role
    name: str
    key: str | None = None
    group: int | None = None
    storage: Storage = Storage.USER
    piece: tuple[int, int] | None = None
    split: Any = None

    @property
    def ident(self) -> tuple:
        return (self.role, self.name, self.key, self.group, self.storage, self.piece)

    def describe(self) -> str:
        """Short human form: ``param fc1.weight``, ``optimizer_state fc1.weight[exp_avg]``,
        ``param fc1.weight{0:64} (rank)``."""
        text = f"{self.role} {self.name}"
        if self.key is not None:
            text += f"[{self.key}]"
        if self.piece is not None:
            text += f"{{{self.piece[0]}:{self.piece[1]}}}"
        if self.split is not None:
            text += f"<tp {self.split.describe()}>"
        if self.group is not None:
            text += f" (group {self.group})"
        if self.storage is not Storage.USER:
            text += f" ({self.storage})"
        return text

@dataclass(frozen=True)
class StepSignature:
    """Roles of a step graph's inputs and outputs, and how to rebuild the
    user's return value.

    ``user_output_spec`` is the pytree spec of what the user's step returned;
    its leaves come, in order, from the USER_OUTPUT slots (for tensor and
    symbolic-scalar leaves) or from ``user_output_constants`` (for leaves that
    were Python constants at capture time; ``None`` marks a slot-supplied leaf
    in that tuple, see ``user_output_from_slot``).
    """

    inputs: tuple[Slot, ...]
    outputs: tuple[Slot, ...]
    user_output_spec: TreeSpec | None = None
    user_output_constants: tuple[Any, ...] = ()
    user_output_from_slot: tuple[bool, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def input_index(self) -> dict[tuple, int]:
        return {s.ident: i for i, s in enumerate(self.inputs)}

    def output_index(self) -> dict[tuple, int]:
        return {s.ident: i for i, s in enumerate(self.outputs)}

    def inputs_with(self, role: Role) -> list[tuple[int, Slot]]:
        return [(i, s) for i, s in enumerate(self.inputs) if s.role is role]

    def outputs_with(self, role: Role) -> list[tuple[int, Slot]]:
        return [(i, s) for i, s in enumerate(self.outputs) if s.role is role]

    def with_outputs(self, outputs: tuple[Slot, ...]) -> "StepSignature":
        return replace(self, outputs=tuple(outputs))

    def with_inputs(self, inputs: tuple[Slot, ...]) -> "StepSignature":
        return replace(self, inputs=tuple(inputs))

    def check_unique(self) -> list[str]:
        """Problems with slot identities (duplicates), as messages."""
        problems = []
        for where, slots in (("input", self.inputs), ("output", self.outputs)):
            seen: set[tuple] = set()
            for s in slots:
                if s.ident in seen:
                    problems.append(f"duplicate {where} slot {s.describe()}")
                seen.add(s.ident)
        n_from_slot = sum(self.user_output_from_slot)
        n_user = len(self.outputs_with(Role.USER_OUTPUT))
        if self.user_output_spec is not None and n_from_slot != n_user:
            problems.append(
                f"{n_user} user_output slots but the output spec takes {n_from_slot} leaves from slots"
            )
        return problems


def hyperparam_tensor(value) -> "torch.Tensor":
    """How a HYPERPARAM slot is fed: a float64 CPU scalar, so the
    optimizer's Python arithmetic on it (captured as symbolic floats) runs
    in double precision exactly as eager PyTorch's does."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device="cpu", dtype=torch.float64).reshape(())
    return torch.tensor(float(value), dtype=torch.float64)


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and device of a tensor that is not at hand (held in
    pieces by a rank, say): capture makes a fake tensor from it."""

    shape: tuple[int, ...]
    dtype: "torch.dtype"
    device: "torch.device"

    @classmethod
    def of(cls, t) -> "TensorSpec":
        return cls(tuple(t.shape), t.dtype, t.device)

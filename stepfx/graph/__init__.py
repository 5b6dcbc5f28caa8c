"""The step IR: StepGraph, its signature, op kinds, printer and invariants.

Shared by capture (which produces step graphs), passes (which rewrite them)
and the runtime (which binds and runs them). Imports nothing else of stepfx.
"""
from .update_rule import UPDATE_RULES_KEY, UpdateRule
from .signature import (CARRIED_COPIES_KEY, HOST_PINNED_KEY, MASTER_COPIES_KEY, HOST_STATE_KEY, HOST_STATE_NVME_KEY, RUNTIME_INIT_KEY, SHARED_STEP_KEY, STATE_ROLES, CarriedCopies, Role, Slot, StepSignature,
                        Storage, TensorSpec)
from .step_graph import (
    META_DONATED,
    META_GRAD_OF,
    META_GRAD_PIECE,
    META_OVERFLOW,
    META_PARAM,
    META_PHASE,
    META_SLOT,
    META_SOURCE,
    Phase,
    StepGraph,
    output_node,
    output_values,
    placeholders,
)
from .printer import format_graph
from .verify import verify_step_graph

__all__ = [
    "CARRIED_COPIES_KEY",
    "HOST_STATE_KEY",
    "HOST_STATE_NVME_KEY",
    "HOST_PINNED_KEY",
    "MASTER_COPIES_KEY",
    "CarriedCopies",
    "Role",
    "Slot",
    "Storage",
    "TensorSpec",
    "StepSignature",
    "STATE_ROLES",
    "RUNTIME_INIT_KEY",
    "SHARED_STEP_KEY",
    "Phase",
    "StepGraph",
    "META_PARAM",
    "META_PHASE",
    "META_SLOT",
    "META_SOURCE",
    "META_GRAD_OF",
    "META_GRAD_PIECE",
    "META_OVERFLOW",
    "META_DONATED",
    "placeholders",
    "output_node",
    "output_values",
    "format_graph",
    "verify_step_graph",
    "UpdateRule",
    "UPDATE_RULES_KEY",
]

"""What a step will cost each rank, predicted without GPUs or a process group.

``predict`` builds the model on the meta device (no memory for weights),
captures the step over it with fake tensors and runs the same pass pipeline
a real run of ``world_size`` ranks would run on rank ``rank`` (ZeRO layout,
collectives, precision, fusions for ``device``), then reads the per-rank
memory (at rest by role, and the peak of a liveness walk) and the
collectives (payload and bytes sent per step) off the final graph, as
``explain()`` does for a running step. Nothing is executed: the plan's
collectives name a group that does not exist.

    from stepfx.planning import predict
    p = predict(train_step, "ds_config.json", make_model, torch.empty(4, 2049, dtype=torch.long, device="meta"),
                world_size=64)
    print(p)                  # or p.to_json()

``stepfx plan MODULE:FACTORY CONFIG --world-size N --batch 4x2049`` is the
same from the command line.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .config import load_config
from .graph import Role, StepGraph
from .graph.accounting import CommItem, MemoryEstimate, communication, estimate_memory

__all__ = ["Prediction", "predict", "causal_lm_step", "next_token_step"]


def causal_lm_step(model, optimizer, input_ids):
    """A Hugging Face causal LM's step: the model shifts the labels itself."""
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def next_token_step(model, optimizer, tokens):
    """A model returning logits: cross-entropy of each next token."""
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@dataclass
class Prediction:
    """The final per-rank graph of a step and what it costs rank ``rank``."""

    world_size: int
    rank: int
    device_type: str
    memory: MemoryEstimate
    collectives: list[CommItem]
    graph: StepGraph
    parameters: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def sent_bytes(self) -> float:
        return sum(c.sent_bytes for c in self.collectives)

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size, "rank": self.rank, "device": self.device_type, "parameters": self.parameters,
            "at_rest_bytes": {str(role): int(n) for role, n in self.memory.at_rest.items()},
            "peak_bytes": int(self.memory.peak), "peak_at": self.memory.peak_node,
            "collectives": [{"op": c.op, "payload_bytes": int(c.payload_bytes), "sent_bytes": float(c.sent_bytes)}
                            for c in self.collectives],
            "sent_bytes_per_step": float(self.sent_bytes), "notes": self.notes,
        }

    def __str__(self) -> str:
        from .explain import format_bytes

        lines = [f"predicted for rank {self.rank} of {self.world_size} on {self.device_type} "
                 f"({self.parameters:,} parameters; captured and planned in {self.seconds:.1f} s, nothing run)"]
        lines.append("memory on this rank:")
        for role in (Role.PARAM, Role.GRAD, Role.OPTIMIZER_STATE, Role.BUFFER, Role.BATCH):
            lines.append(f"  {str(role) + ' at rest':<28}{format_bytes(self.memory.at_rest.get(role, 0)):>12}")
        lines.append(f"  {'peak during the step':<28}{format_bytes(self.memory.peak):>12}  (at {self.memory.peak_node})")
        counts: dict[str, list[CommItem]] = {}
        for c in self.collectives:
            counts.setdefault(c.op, []).append(c)
        lines.append(f"communication per step: {format_bytes(self.sent_bytes)} sent by this rank")
        for op, items in counts.items():
            lines.append(f"  {op:<16} x{len(items):<5} payload {format_bytes(sum(c.payload_bytes for c in items)):>10}, "
                         f"sent {format_bytes(sum(c.sent_bytes for c in items)):>10}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def predict(train_step: Callable, config: Any, make_model: Callable[[], torch.nn.Module], *batch: Any,
            make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None, world_size: int = 1,
            rank: int = 0, device: str = "cuda", **batch_kwargs: Any) -> Prediction:
    """Capture ``train_step(model, optimizer, *batch, **batch_kwargs)`` over a
    meta-device model and plan it for rank ``rank`` of ``world_size`` on
    ``device`` (see the module docstring). ``batch`` tensors should be on the
    meta device; ``make_optimizer`` defaults to the config's optimizer block,
    else AdamW (said in the notes)."""
    from .api import (ParallelStep, _resolve_batch_sizes, _resolve_codegen, _resolve_cuda_graphs, _resolve_model_sizes,
                      _resolve_precision)
    from .config.implicit import fill_auto_clipping
    from .runtime.distributed import DataParallel

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of the {world_size} ranks")
    start = time.perf_counter()
    with torch.device("meta"):
        model = make_model()
    notes = []
    step = ParallelStep(train_step, load_config(config))
    step.config, clip_note = fill_auto_clipping(_resolve_precision(_resolve_model_sizes(step.config, model)))
    notes += [clip_note] if clip_note else []
    step.config = _resolve_cuda_graphs(_resolve_codegen(step.config, device), device)
    step._dp = DataParallel(world_size=world_size, rank=rank, group_name="stepfx-plan (not run)")
    step.config = _resolve_batch_sizes(step.config, world_size)
    optimizer = make_optimizer(model) if make_optimizer is not None else None
    if optimizer is None and step.config.optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters())
        notes.append("no optimizer given and the config has no optimizer block: planned with AdamW")
    optimizer = step._config_optimizer(model, optimizer)
    step._create_optimizer_state(model, optimizer)
    plan = step._build_plan(("stepfx plan",), model, optimizer, batch, batch_kwargs, step._capture_options())
    final = plan.graph
    return Prediction(world_size, rank, device, estimate_memory(final), communication(final, world_size), final,
                      sum(p.numel() for p in model.parameters()), time.perf_counter() - start, notes)

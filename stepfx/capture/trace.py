"""Capture a user's whole training step as one aten-level fx graph.

How (see NOTES-torch.md for the measured facts behind each choice):

- The user's step runs unchanged under ``make_fx`` over fake tensors. Its
  module's parameters and buffers are swapped for traced values
  (``compat.reparametrize_module``), and the optimizer's param groups and
  state are swapped the same way, so ``loss.backward()`` and
  ``optimizer.step()`` record their ops into the same graph as the forward.
- The learning rate of each param group enters as a float64 0-dim tensor and
  is read with ``.item()`` into a symbolic float; the optimizer's Python
  arithmetic on it and on its step counters (bias corrections, step sizes)
  is recorded in the graph instead of being frozen at capture-time values.
- Phases are recorded as the trace runs: ``optimizer.step`` hooks and a
  wrapper around ``torch.autograd.backward`` annotate the nodes they produce.
- The result keeps the optimizer's in-place updates (the graph is not yet
  functional); the ``functionalize_graph`` pass makes it so.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.utils._pytree as pytree

from .. import compat
from ..errors import CaptureError
from ..graph import (
    META_GRAD_OF,
    META_PHASE,
    META_SLOT,
    META_SOURCE,
    SHARED_STEP_KEY,
    Phase,
    Role,
    Slot,
    StepGraph,
    StepSignature,
    TensorSpec,
    output_values,
)
from ..graph.layout import FROZEN_KEY
from ..graph.ops import mutated_args
from ..graph.verify import mutation_base
from ..graph.signature import hyperparam_tensor
from ..graph.update_rule import UPDATE_RULES_KEY, update_rule_of
from ..graph.build import bind_placeholders, flatten_codegen, label_params
from .decompositions import SYMBOLIC_DECOMPOSITIONS
from .batch_reads import BatchReads
from .number_arguments import as_input as number_input, is_number
from .dynamic import DYNAMIC_KEY
from .checks import BufferDtypeError, check_mutations, check_operand_dtypes, warn_python_only_reads
from .host_random import refuse_host_random
from .host_objects import refuse_host_objects
from .tracing_checks import TRACING_CHECKS_KEY, watch_tracing_checks
from .raising_checks import RaisingCheck, clamping_branch, in_clamping_body, raising_check
from .optimizers import check_optimizer, hyperparam_inputs, state_tensors, steps_agree, trace_overrides
from .source import (format_frame, innermost_user_frame, innermost_user_line, library_of_traceback,
                     other_module_tensors, user_frame_from_traceback, user_frame_of_caller)

__all__ = ["StepInputs", "collect_inputs", "capture_step"]

# make_fx, fx's node-meta annotations and the backward wrapper are process
# globals: two threads capturing at once (threaded ranks) would mix them.
_CAPTURE_LOCK = threading.Lock()


@dataclass(frozen=True)
class CaptureOptions:
    """How the step is to be captured (what the config asks for).

    - ``compute_dtype``: forward and backward run on copies of the fp32
      parameters cast to this dtype (bf16/fp16); autograd carries the
      gradients back through the casts, so the optimizer sees fp32 masters
      and fp32 gradients.
    - ``loss_scale``: ``loss.backward()`` back-propagates ``loss * scale``,
      the scale being a runtime-state input (fp16 dynamic loss scaling).
    - ``grad_accumulation``: the loss is divided by it before backward
      (gradients accumulate as the mean over micro-batches), and the user's
      ``zero_grad`` calls are no-ops — stepfx clears the gradients after an
      update.
    - ``accumulate_only``: a micro-step without update: ``optimizer.step()``
      is a no-op too and the accumulated gradients are outputs.
    """

    compute_dtype: torch.dtype | None = None
    cast_inputs: bool = False  # floating-point batch tensors are cast to compute_dtype (fp16 "auto_cast")
    # floating buffers that meet 16-bit weights in a matrix product are read in compute_dtype, as DeepSpeed's
    # module.bfloat16() holds them (stepfx.cast_buffers; False: refused instead); buffers_cast: those found so
    cast_buffers: bool = True
    buffers_cast: frozenset = frozenset()
    loss_scale: bool = False
    grad_accumulation: int = 1
    accumulate_only: bool = False


LOSS_SCALE = "loss_scale"  # the RUNTIME_STATE slot capture multiplies the loss by


@dataclass
class StepInputs:
    """The step's inputs in graph order: slots and the live tensors behind them."""

    slots: list[Slot]
    values: list[torch.Tensor]
    param_names: dict[int, str]  # id(parameter) -> fully qualified name
    group_params: list[list[str]]  # optimizer param group -> parameter names
    batch_spec: pytree.TreeSpec
    batch_leaves: list[Any]  # every leaf of (args, kwargs); tensors are graph inputs
    shared_step: bool = False  # all optimizer step counters are equal (read once)
    # the parameters whose step counter this rank holds (not those wholly on
    # other ranks under ZeRO): the shared count is read from one of these
    shared_step_names: frozenset[str] = frozenset()
    # the places in batch_leaves of Python number arguments fed as BATCH slots (number_arguments.py): the step
    # reads them with .item()
    number_leaves: frozenset[int] = frozenset()


def _keystr(path) -> str:
    return pytree.keystr(path) if path else "<root>"


def collect_inputs(
    model: torch.nn.Module,
    optimizer,
    args: tuple,
    kwargs: dict,
    held: Mapping | None = None,
    options: CaptureOptions = CaptureOptions(),
    numbers: frozenset[str] = frozenset(),
) -> StepInputs:
    """Enumerate every input of the step: params, buffers, existing grads,
    optimizer state, learning rates and batch tensors, in that order.

    ``held`` describes state the user's objects no longer hold because a
    rank keeps it in pieces (ZeRO): ``(Role.PARAM, name, None)`` and
    ``(Role.OPTIMIZER_STATE, name, key)`` map to the whole tensor's
    :class:`TensorSpec`; those inputs are described by the spec instead of
    read from the module or optimizer. ``numbers``: paths of Python number
    arguments fed as 0-d tensors (``capture/number_arguments.py``)."""
    check_optimizer(optimizer)
    held = held or {}
    slots: list[Slot] = []
    values: list = []

    named_params = list(model.named_parameters())
    param_names = {id(p): name for name, p in named_params}
    for name, p in named_params:
        slots.append(Slot(Role.PARAM, name))
        values.append(held.get((Role.PARAM, name, None), p))
    for name, b in model.named_buffers():
        slots.append(Slot(Role.BUFFER, name))
        values.append(b)
    for name, p in named_params:
        grad = held.get((Role.GRAD, name, None), p.grad)
        if grad is not None:
            slots.append(Slot(Role.GRAD, name))
            values.append(grad)

    group_params: list[list[str]] = []
    if optimizer is not None:
        for g, group in enumerate(optimizer.param_groups):
            names = []
            for i, p in enumerate(group["params"]):
                name = param_names.get(id(p))
                if name is None:
                    raise CaptureError(
                        f"optimizer param group {g}, parameter #{i} (shape {tuple(p.shape)}) is not a parameter of the model",
                        hint="register every optimized tensor on the module as an nn.Parameter, so the step can swap it for a traced value",
                    )
                names.append(name)
            group_params.append(names)
        held_state: dict[str, dict] = collections.defaultdict(dict)
        for (role, name, key), spec in held.items():
            if role is Role.OPTIMIZER_STATE:
                held_state[name][key] = spec
        # a micro-step without update reads no optimizer state or hyperparameter
        for g, names in enumerate(group_params if not options.accumulate_only else ()):
            for name, p in zip(names, optimizer.param_groups[g]["params"]):
                # what the rank holds for the optimizer (pieces, released state) over what the optimizer has: a
                # pipeline rank releases another stage's moments but keeps its step counter in the optimizer
                state = {**state_tensors(optimizer, p, f"state[{name}]"), **held_state.get(name, {})}
                for key, value in sorted(state.items()):
                    slots.append(Slot(Role.OPTIMIZER_STATE, name, key=key))
                    values.append(value)
        for g, group in enumerate(optimizer.param_groups if not options.accumulate_only else ()):
            for name, value in hyperparam_inputs(group):
                slots.append(Slot(Role.HYPERPARAM, name, group=g))
                values.append(hyperparam_tensor(value))

    if options.loss_scale:
        device = named_params[0][1].device if named_params else torch.device("cpu")
        slots.append(Slot(Role.RUNTIME_STATE, LOSS_SCALE))
        values.append(held.get((Role.RUNTIME_STATE, LOSS_SCALE, None), TensorSpec((), torch.float32, device)))

    leaves_with_path, batch_spec = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    batch_leaves = []
    number_leaves = set()
    for path, leaf in leaves_with_path:
        batch_leaves.append(leaf)
        if isinstance(leaf, torch.Tensor):
            slots.append(Slot(Role.BATCH, batch_slot_name(path)))
            values.append(leaf)
        elif numbers and is_number(leaf) and pytree.keystr(path) in numbers:
            slots.append(Slot(Role.BATCH, batch_slot_name(path)))
            values.append(number_input(leaf))
            number_leaves.add(len(batch_leaves) - 1)
    # a frozen parameter's counter (state made before it was frozen, or at construction: Adagrad) never advances
    # and no update reads it: it neither decides nor stands for the shared count
    frozen = {name for name, p in named_params if not p.requires_grad}
    steps = [(slot.name, v) for slot, v in zip(slots, values)
             if slot.role is Role.OPTIMIZER_STATE and slot.key == "step" and slot.name not in frozen]
    shared = steps_agree([v for _, v in steps])
    held_here = frozenset(name for name, v in steps if not isinstance(v, TensorSpec))
    return StepInputs(slots, values, param_names, group_params, batch_spec, batch_leaves, shared, held_here,
                      frozenset(number_leaves))


def batch_slot_name(path) -> str:
    # path[0] selects args (0) or kwargs (1); show it the way the user wrote it
    head, rest = path[0], path[1:]
    where = "args" if getattr(head, "idx", None) == 0 else "kwargs"
    return where + pytree.keystr(rest)


class _Recorder:
    """What the traced function learns while it runs: output slots and the
    user's output structure."""

    def __init__(self):
        self.output_slots: list[Slot] = []
        self.user_spec = None
        self.user_constants: list[Any] = []
        self.user_from_slot: list[bool] = []


@contextlib.contextmanager
def _phase_hooks(optimizer, leaves: dict[str, torch.Tensor], loss_factor=None):
    """Annotate nodes made inside ``torch.autograd.backward``/``grad`` as
    backward and inside ``optimizer.step`` as optimizer. ``loss_factor``
    (a tensor or number) multiplies a scalar loss before backward.

    After each ``backward``, every parameter's ``.grad`` is re-pointed at an
    ``aten.alias`` of itself annotated ``grad_of=<param>``: the marker that
    tells later passes which value is the gradient the step accumulated
    (ZeRO reduces it right there, as DDP reduces in backward hooks)."""
    real_backward, real_grad = torch.autograd.backward, torch.autograd.grad

    def wrap(fn, marks_grads):
        def wrapper(*a, **k):
            source = user_frame_of_caller()
            with compat.annotate_nodes({"phase": Phase.BACKWARD.value, "source": source}):
                if loss_factor is not None and a and isinstance(a[0], torch.Tensor) and a[0].numel() == 1:
                    # loss scaling / accumulation: back-propagate loss * factor
                    a = (a[0] * loss_factor,) + a[1:]
                result = fn(*a, **k)
                if marks_grads:
                    with torch.no_grad():
                        for name, leaf in leaves.items():
                            if leaf.grad is not None:
                                with compat.annotate_nodes({"grad_of": name}):
                                    leaf.grad = torch.ops.aten.alias.default(leaf.grad)
            return result

        return wrapper

    handles = []
    stack: list[contextlib.AbstractContextManager] = []
    if optimizer is not None:

        def pre(*_):
            cm = compat.annotate_nodes({"phase": Phase.OPTIMIZER.value})
            cm.__enter__()
            stack.append(cm)

        def post(*_):
            stack.pop().__exit__(None, None, None)

        handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
    torch.autograd.backward, torch.autograd.grad = wrap(real_backward, True), wrap(real_grad, False)
    try:
        yield
    finally:
        torch.autograd.backward, torch.autograd.grad = real_backward, real_grad
        for h in handles:
            h.remove()
        while stack:
            stack.pop().__exit__(None, None, None)


@contextlib.contextmanager
def _swapped_optimizer(optimizer, group_params, leaves, hyper, states):
    """Point the optimizer at traced parameters, hyperparameters and state.
    Hyperparameters that are graph inputs become symbolic floats
    (``.item()`` of the traced input), so the optimizer's Python arithmetic
    on them is recorded in the graph."""
    if optimizer is None:
        yield
        return
    saved_groups = [dict(group) for group in optimizer.param_groups]
    saved_state = optimizer.state
    user_groups = list(optimizer.param_groups)
    new_state: dict = collections.defaultdict(dict)
    for (name, key), value in states.items():
        new_state[leaves[name]][key] = value
    try:
        for g, group in enumerate(user_groups):
            group["params"] = [leaves[n] for n in group_params[g]]
            with compat.annotate_nodes({"phase": Phase.OPTIMIZER.value}):
                if "lr" in hyper[g]:  # (none in a micro-step without update)
                    group["lr"] = hyper[g]["lr"].item()
                if "beta1" in hyper[g]:
                    group["betas"] = (hyper[g]["beta1"].item(), hyper[g]["beta2"].item())
            group.update(trace_overrides(group))
            _watch_group(optimizer, g, group)
        optimizer.state = new_state
        yield
        for g, group in enumerate(optimizer.param_groups):
            if isinstance(group, _WatchedGroup) and group.lr_set_at is not _NOT_SET:
                raise CaptureError(
                    f"the step sets the learning rate of the optimizer's param group {g} in Python, which inside a "
                    "captured step runs once, at capture: the value it set would be kept for every later call (or, "
                    "where it comes from an argument, the step captured again at each new value)",
                    source=group.lr_set_at,
                    hint="set param_groups[...]['lr'] before calling the step (stepfx reads the learning rate at every "
                         "call), or step a torch lr scheduler after the step, or use the config's scheduler block",
                )
    finally:
        optimizer.param_groups[:len(user_groups)] = user_groups
        for group, saved in zip(optimizer.param_groups, saved_groups):
            group.clear()
            group.update(saved)
        optimizer.state = saved_state


_NOT_SET = object()


def _watch_group(optimizer, g: int, group: dict) -> None:
    """Put a :class:`_WatchedGroup` in place of param group ``g`` where the
    optimizer's ``param_groups`` is a list that keeps it (a wrapper whose
    property builds a new list each time is left unwatched)."""
    try:
        optimizer.param_groups[g] = watched = _WatchedGroup(group)
    except TypeError:
        return
    if optimizer.param_groups[g] is not watched:
        return


class _WatchedGroup(dict):
    """An optimizer param group during the trace: the same entries, noting
    where the step assigns ``lr`` (a Python learning-rate schedule written
    in the step would run once, at capture)."""

    def __init__(self, group: dict):
        super().__init__(group)
        self.lr_set_at: Any = _NOT_SET

    def __setitem__(self, key, value):
        if key == "lr" and self.lr_set_at is _NOT_SET:
            self.lr_set_at = innermost_user_frame()
        super().__setitem__(key, value)


class _TraceGuard(compat.dispatch_mode_base()):
    """Sees every op of the user's step before make_fx does.

    - Refuses in-place writes into real (untraced) tensors: make_fx executes
      ops on real tensors it meets (globals, closure variables, unregistered
      module attributes) for real, so capture would change the user's data.
    - Reads all optimizer step counters as one symbolic value when they are
      known to be equal (``shared_steps``: the traced step-state tensors),
      see ``optimizers.shared_step_count``.
    - Records the user's source line of each op in the node annotations
      (cheaper than make_fx's stack traces, which format every frame).
    - Records an op whose kernel needs grad mode (oneDNN's LSTM layer) as
      its twin that turns grad mode on (``compat.grad_mode_twin``).
    """

    def __init__(self, shared_steps: frozenset[int] = frozenset(), others: Mapping[int, str] | None = None):
        super().__init__()
        self.shared_steps = shared_steps
        self.others = others or {}  # id -> where: tensors of modules other than the trained one (EMA, teacher)
        self.step_value = None
        self.clamping: tuple | None = None  # (ClampingBranch, "the body runs" as a traced bool) while in its body
        # draws uniform in [0, 1), and comparisons of them with numbers whose answer no draw can change:
        # id -> (the tensor, its answer or None for a draw)
        self.uniform: dict[int, tuple[torch.Tensor, object]] = {}  # _UNDECIDED: draws answer differently

    def _known(self, value) -> tuple[torch.Tensor, object] | None:
        entry = self.uniform.get(id(value)) if isinstance(value, torch.Tensor) else None
        return entry if entry is not None and entry[0] is value else None

    def _decided(self, func, args, out):
        """Note ``out`` when it is a uniform draw, or a comparison of one with a number that every draw
        answers alike: transformers 4.x's layerdrop (``if torch.rand([]) < self.layerdrop: continue`` in
        OPT, BART, Whisper and their kin, with layerdrop 0.0 by default) is then a branch Python takes
        without a guard on the device's value; the draw stays (it advances the generator as in eager)."""
        if func in _UNIFORM_DRAWS or (func in _SAME_VALUES and args and (draw := self._known(args[0])) is not None
                                      and draw[1] is None):
            self.uniform[id(out)] = (out, None)
        elif func in _COMPARISONS and len(args) >= 2 and isinstance(args[1], (int, float)) \
                and (draw := self._known(args[0])) is not None and draw[1] is None:
            answer = _COMPARISONS[func](float(args[1]))
            self.uniform[id(out)] = (out, _UNDECIDED if answer is None else answer)
        return out

    def _enter_clamping(self, value: torch.Tensor, branch) -> bool | int | float:
        """An ``if`` whose body only clamps (raising_checks.py): Python enters the body, and each clamp in it
        is selected by the traced truth value, so the device takes eager's side."""
        with compat.annotate_nodes({"source": branch.source}):
            truth = value if value.dtype is torch.bool else torch.ops.aten.ne.Scalar(value, 0)
            runs = truth if branch.body_when else torch.ops.aten.logical_not.default(truth)
        self.clamping = (branch, runs)
        kind = bool if value.dtype is torch.bool else float if value.is_floating_point() else int
        return kind(branch.body_when)

    def _clamp_selected(self, func, args, kwargs):
        branch, runs = self.clamping
        out = self._checked(func, args, kwargs)
        with compat.annotate_nodes({"source": branch.source}):
            return torch.ops.aten.where.self(runs, out, args[0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and id(args[0]) in self.shared_steps:
            if self.step_value is None:
                self.step_value = func(*args, **kwargs)
            return self.step_value
        if func is torch.ops.aten._local_scalar_dense.default and (known := self._known(args[0])) is not None \
                and known[1] is not None:
            if known[1] is _UNDECIDED:
                raise CaptureError(
                    "the step branches on a random draw (a layer skipped at random: layerdrop), which one captured "
                    "graph cannot follow", source=user_frame_of_caller(),
                    hint="set the model's layerdrop to 0 (transformers: model.config.layerdrop = 0; DeepSpeed "
                         "recipes train with it off), or draw the skip outside the step")
            return known[1]
        if func is torch.ops.aten._local_scalar_dense.default and (check := raising_check()) is not None:
            return _assert_check(args[0], check)
        if func is torch.ops.aten._local_scalar_dense.default and (branch := clamping_branch()) is not None:
            return self._enter_clamping(args[0], branch)
        if self.clamping is not None:
            if not in_clamping_body(self.clamping[0]):
                self.clamping = None
            elif func in _CLAMP_OPS:  # (other ops in the body are bookkeeping: its statements only clamp)
                return self._clamp_selected(func, args, kwargs)
        func = compat.grad_mode_twin(func)  # the graph runs under no_grad: see compat._grad_mode_twins
        source = innermost_user_frame()
        if source is not None:
            with compat.annotate_nodes({"source": source}):
                return self._decided(func, args, self._checked(func, args, kwargs))
        return self._decided(func, args, self._checked(func, args, kwargs))

    def _checked(self, func, args, kwargs):
        schema = getattr(func, "_schema", None)
        if schema is not None:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(value, torch.Tensor) and not compat.is_fake(value) and id(value) in self.others:
                    raise CaptureError(
                        f"the step writes in place ({func}) into {self.others[id(value)]}: stepfx captures the state "
                        "of the model it trains (its parameters and buffers) and of its optimizer; another module's "
                        "tensors are constants of the captured step, so the write would not happen at later calls",
                        source=user_frame_of_caller(),
                        hint="keep what the step updates (EMA weights, running statistics) as buffers of the trained "
                             "model (model.register_buffer(...)) and update those in the step, or update the other "
                             "module after the step returns (under ZeRO-3 after step.sync_model())",
                    )
                if isinstance(value, torch.Tensor) and not compat.is_fake(value):
                    raise CaptureError(
                        f"the step writes in place ({func}) into a tensor that is not a parameter, buffer, "
                        "optimizer state or argument of the step (a global, a closure variable or a module "
                        "attribute that is not registered)",
                        source=user_frame_of_caller(),
                        hint="register the tensor on the module (register_buffer) or return its new value from the step",
                    )
        return func(*args, **kwargs)


_UNDECIDED = object()  # a comparison of a draw whose answer depends on the draw
_UNIFORM_DRAWS = frozenset({torch.ops.aten.rand.default, torch.ops.aten.rand_like.default})
_SAME_VALUES = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.clone.default})
# a comparison of a draw u in [0, 1) with c -> its answer for every u, or None where draws differ
_COMPARISONS = {
    torch.ops.aten.lt.Scalar: lambda c: False if c <= 0 else True if c >= 1 else None,
    torch.ops.aten.le.Scalar: lambda c: False if c < 0 else True if c >= 1 else None,
    torch.ops.aten.gt.Scalar: lambda c: True if c < 0 else False if c >= 1 else None,
    torch.ops.aten.ge.Scalar: lambda c: True if c <= 0 else False if c >= 1 else None,
}
_CLAMP_OPS = frozenset({torch.ops.aten.clamp.default, torch.ops.aten.clamp.Tensor, torch.ops.aten.clip.default,
                        torch.ops.aten.clip.Tensor})


def _assert_check(value: torch.Tensor, check: RaisingCheck):
    """A branch whose one side only raises (raising_checks.py): record
    that the tensor's truth is the passing one as a run-time assertion, and
    let Python take the passing side."""
    with compat.annotate_nodes({"source": check.source}):
        ok = value if check.passes_when else torch.ops.aten.logical_not.default(value)
        torch.ops.aten._assert_async.msg(ok, check.message)
    kind = bool if value.dtype is torch.bool else float if value.is_floating_point() else int
    return kind(check.passes_when)


@contextlib.contextmanager
def _symbolic_kernels(active: bool):
    """With symbolic batch sizes, ``F.scaled_dot_product_attention``,
    ``F.linear`` and ``torch.matmul`` (``@``) run
    ``compat.sdpa_with_symbolic_sizes``, ``compat.linear_with_symbolic_sizes``
    and ``compat.matmul_with_symbolic_sizes`` (the ops eager would run,
    without the C++ composites' size reads that specialize every size on
    torch 2.11)."""
    if not active:
        yield
        return
    F = torch.nn.functional
    real_attention, real_linear = F.scaled_dot_product_attention, F.linear
    real_matmul = torch.matmul
    methods = {name: (name in torch.Tensor.__dict__, getattr(torch.Tensor, name)) for name in ("matmul", "__matmul__")}

    @functools.wraps(real_attention)
    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        out = compat.sdpa_with_symbolic_sizes(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if out is None:
            out = real_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                 scale=scale, enable_gqa=enable_gqa)
        return out

    @functools.wraps(real_linear)
    def linear(input, weight, bias=None):
        out = compat.linear_with_symbolic_sizes(input, weight, bias)
        return real_linear(input, weight, bias) if out is None else out

    def matmul_of(real):
        @functools.wraps(real)
        def matmul(input, other, **kwargs):
            out = None if kwargs else compat.matmul_with_symbolic_sizes(input, other)
            return real(input, other, **kwargs) if out is None else out
        return matmul

    F.scaled_dot_product_attention, F.linear = attention, linear
    torch.matmul = matmul_of(real_matmul)
    for name, (_, real) in methods.items():  # Tensor.matmul and the @ operator (TensorBase's, inherited)
        setattr(torch.Tensor, name, matmul_of(real))
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.linear = real_attention, real_linear
        torch.matmul = real_matmul
        for name, (own, real) in methods.items():
            if own:
                setattr(torch.Tensor, name, real)
            else:
                delattr(torch.Tensor, name)


@contextlib.contextmanager
def _no_ops(model, optimizer, options: CaptureOptions):
    """Under gradient accumulation the user's ``zero_grad`` calls (and, in a
    micro-step without update, ``optimizer.step``) do nothing, as in
    DeepSpeed's engine; stepfx clears gradients after an update itself."""
    if options.grad_accumulation <= 1 and not options.accumulate_only:
        yield
        return
    patched = [(model, "zero_grad")]
    if optimizer is not None:
        patched.append((optimizer, "zero_grad"))
        if options.accumulate_only:
            patched.append((optimizer, "step"))
    had = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name in patched]
    for obj, name in patched:
        setattr(obj, name, lambda *a, **k: None)
    try:
        yield
    finally:
        for obj, name, old in had:
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


_MISSING = object()


def batch_norm_fp32_params(model: torch.nn.Module) -> frozenset[str]:
    """The weights and biases of batch norms whose running statistics are fp32 buffers: under bf16/fp16 they
    stay fp32, as torch's batch norm takes a 16-bit input only with fp32 weight, bias and statistics together
    (16-bit weights beside fp32 statistics fail when the kernel runs); DeepSpeed would hold the statistics in
    16 bits instead (module.bfloat16()), rounding them each step."""
    names = []
    for prefix, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.track_running_stats \
                and isinstance(module.running_mean, torch.Tensor) and module.running_mean.dtype == torch.float32:
            names.extend(f"{prefix}.{n}" if prefix else n for n, p in module.named_parameters(recurse=False))
    return frozenset(names)


@contextlib.contextmanager
def gradients_on_masters(masters: dict, *, loss_scaled: bool = False):
    """``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` clip, and
    ``nn.Module.zero_grad`` clears, the fp32 masters' gradients where they
    are handed the 16-bit copies a mixed-precision step's module computes
    with (``masters``: id of a copy -> its master), as DeepSpeed clips the
    fp32 gradients.

    Why: while the module is reparametrized, ``model.parameters()`` yields
    the copies, which hold no gradient (they are not leaves), so the usual
    ``clip_grad_norm_(model.parameters(), 1.0)`` after ``backward`` clipped
    nothing and returned a norm of 0, with no word (found 2026-12-06; the
    bf16 reference of the tests had the same defect). Other reads of a
    copy's ``.grad`` are refused at capture (``_grad_of_copies``).
    ``loss_scaled``: the gradients are loss-scaled while the step runs
    (fp16), so a clip there would measure the scaled norm: refused, naming
    the line, for the config's ``gradient_clipping`` (applied unscaled)."""
    from torch.nn.utils import clip_grad

    if not masters:
        yield
        return

    def masters_of(parameters):
        if loss_scaled:
            raise CaptureError(
                "the step clips gradients itself under fp16 loss scaling: while the step runs the gradients are "
                "multiplied by the loss scale, so the clip would measure the scaled norm",
                source=user_frame_of_caller(),
                hint='set "gradient_clipping" in the config instead (stepfx unscales, then clips) and remove the '
                     "clip_grad_norm_/clip_grad_value_ call from the step",
            )
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        return [masters.get(id(p), p) for p in parameters]

    real_norm, real_value = clip_grad.clip_grad_norm_, clip_grad.clip_grad_value_

    def clip_norm(parameters, *args, **kwargs):
        return real_norm(masters_of(parameters), *args, **kwargs)

    def clip_value(parameters, *args, **kwargs):
        return real_value(masters_of(parameters), *args, **kwargs)

    def zero_grad(module, set_to_none: bool = True):  # as torch's, on the masters
        for p in module.parameters():
            p = masters.get(id(p), p)
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    saved = [(module, name, getattr(module, name)) for module in (torch.nn.utils, clip_grad)
             for name in ("clip_grad_norm_", "clip_grad_value_")] + [(torch.nn.Module, "zero_grad",
                                                                     torch.nn.Module.zero_grad)]
    torch.nn.utils.clip_grad_norm_ = clip_grad.clip_grad_norm_ = clip_norm
    torch.nn.utils.clip_grad_value_ = clip_grad.clip_grad_value_ = clip_value
    torch.nn.Module.zero_grad = zero_grad
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@contextlib.contextmanager
def _grad_of_copies(active: bool):
    """Refuse a step that reads ``.grad`` of the 16-bit copies a
    mixed-precision module computes with (``model.parameters()`` yields
    them during the step): they hold no gradient, so a gradient norm or
    check computed from them would silently read nothing. torch warns on
    every read of a non-leaf's ``.grad``; that warning, raised in the user's
    code, becomes the error, naming the line."""
    import warnings

    if not active:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"The \.grad attribute of a Tensor that is not a leaf Tensor")
        try:
            yield
        except UserWarning as exc:
            if "not a leaf Tensor" not in str(exc):
                raise
            raise CaptureError(
                "the step reads .grad of the model's parameters, which under bf16/fp16 are 16-bit copies of the "
                "fp32 masters while the step runs: they hold no gradient",
                source=user_frame_from_traceback(exc.__traceback__),
                hint="clip with the config's gradient_clipping or torch.nn.utils.clip_grad_norm_(model.parameters(), "
                     "...) (both clip the masters' gradients); read gradients from optimizer.param_groups' tensors",
            ) from None


def _make_traced_fn(fn, model, optimizer, inputs: StepInputs, rec: _Recorder, options: CaptureOptions,
                    reads: BatchReads | None = None):
    slots = inputs.slots
    buffer_names = [s.name for s in slots if s.role is Role.BUFFER]
    param_req = {name: p.requires_grad for name, p in model.named_parameters()}
    fp32_params = batch_norm_fp32_params(model) if options.compute_dtype is not None else frozenset()

    def forward(*flat):  # named "forward": fx keeps stack frames from here down
        by_role: dict[Role, list] = collections.defaultdict(list)
        for slot, value in zip(slots, flat):
            by_role[slot.role].append((slot, value))
        leaves = {s.name: v.detach().requires_grad_(param_req[s.name]) for s, v in by_role[Role.PARAM]}
        for s, v in by_role[Role.GRAD]:
            leaves[s.name].grad = v
        states = {(s.name, s.key): v for s, v in by_role[Role.OPTIMIZER_STATE]}
        hyper: dict[int, dict[str, torch.Tensor]] = collections.defaultdict(dict)
        for s, v in by_role[Role.HYPERPARAM]:
            hyper[s.group][s.name] = v
        batch_values = [v for _, v in by_role[Role.BATCH]]
        symbolic = any(isinstance(size, torch.SymInt) for v in batch_values for size in v.shape)
        # which BATCH values are numbers: the batch leaves that are inputs, in order
        numbers = [i in inputs.number_leaves for i, x in enumerate(inputs.batch_leaves)
                   if isinstance(x, torch.Tensor) or i in inputs.number_leaves]
        if options.cast_inputs and options.compute_dtype is not None:
            with compat.annotate_nodes({"phase": Phase.FORWARD.value}):
                batch_values = [v.to(options.compute_dtype) if v.is_floating_point() and not number else v
                                for v, number in zip(batch_values, numbers)]
        with compat.annotate_nodes({"phase": Phase.FORWARD.value}):  # a number argument: read as Python's
            batch_values = [v.item() if number else v for v, number in zip(batch_values, numbers)]
        batch_iter = iter(batch_values)
        leaves_in = [next(batch_iter) if isinstance(x, torch.Tensor) or i in inputs.number_leaves else x
                     for i, x in enumerate(inputs.batch_leaves)]
        args, kwargs = pytree.tree_unflatten(leaves_in, inputs.batch_spec)
        if reads is not None:  # which entries of the batch dicts the step fetches (batch_reads.py)
            args, kwargs = reads.watch(args, kwargs)
        module_tensors = dict(leaves)
        if options.compute_dtype is not None:
            # the module computes with low-precision copies of the fp32 masters; batch norms with fp32 running
            # statistics read their fp32 weight and bias (torch's mixed-type batch norm: 16-bit in and out)
            with compat.annotate_nodes({"phase": Phase.FORWARD.value}):
                module_tensors = {
                    n: (t.to(options.compute_dtype) if t.is_floating_point() and n not in fp32_params else t)
                    for n, t in module_tensors.items()
                }
        buffers = {s.name: v for s, v in by_role[Role.BUFFER]}
        if options.buffers_cast and options.compute_dtype is not None:
            with compat.annotate_nodes({"phase": Phase.FORWARD.value}):
                module_tensors.update({n: v.to(options.compute_dtype) if n in options.buffers_cast else v
                                       for n, v in buffers.items()})
        else:
            module_tensors.update(buffers)
        factor = None
        if options.loss_scale:
            (factor,) = [v for s, v in by_role[Role.RUNTIME_STATE] if s.name == LOSS_SCALE]
        if options.grad_accumulation > 1:
            factor = (factor if factor is not None else 1.0) / options.grad_accumulation

        copies = {id(module_tensors[n]): leaf for n, leaf in leaves.items() if module_tensors[n] is not leaf}
        others = other_module_tensors(fn, args, kwargs, model)  # (named if the step writes into them)
        with compat.reparametrize_module(model, module_tensors), _swapped_optimizer(
            optimizer, inputs.group_params, leaves, hyper, states
        ), gradients_on_masters(copies, loss_scaled=bool(options.loss_scale)), _grad_of_copies(bool(copies)):
            shared = frozenset(id(v) for (name, key), v in states.items()
                               if key == "step" and name in inputs.shared_step_names) if inputs.shared_step else frozenset()
            with compat.annotate_nodes({"phase": Phase.FORWARD.value}), _phase_hooks(optimizer, leaves, factor), _TraceGuard(
                shared, others
            ), _no_ops(model, optimizer, options), _symbolic_kernels(symbolic):
                result = fn(model, optimizer, *args, **kwargs)
            if options.grad_accumulation > 1 and not options.accumulate_only:
                for leaf in leaves.values():
                    leaf.grad = None  # gradients are cleared after the update
            # a buffer read as a 16-bit copy and not replaced keeps its own value
            out_buffers = [buffers[n] if n in options.buffers_cast and model.get_buffer(n) is module_tensors[n]
                           else model.get_buffer(n) for n in buffer_names]
            out_states = []
            if optimizer is not None:
                reverse = {id(t): n for n, t in leaves.items()}
                for g, names in enumerate(inputs.group_params):
                    for name in names:
                        st = optimizer.state.get(leaves[name], {})
                        for key in sorted(st):
                            if isinstance(st[key], torch.Tensor):
                                out_states.append((Slot(Role.OPTIMIZER_STATE, name, key=key), st[key]))
                stray = [t for t in optimizer.state if id(t) not in reverse]
                if stray:
                    raise CaptureError("the optimizer created state for a tensor that is not one of its parameters")

        outs: list = []
        rec.output_slots = []

        def emit(slot, value):
            rec.output_slots.append(slot)
            outs.append(value)

        for name, leaf in leaves.items():
            emit(Slot(Role.PARAM, name), leaf)
        for name, value in zip(buffer_names, out_buffers):
            emit(Slot(Role.BUFFER, name), value)
        for name, leaf in leaves.items():
            if leaf.grad is not None:
                emit(Slot(Role.GRAD, name), leaf.grad)
        for slot, value in out_states:
            emit(slot, value)

        flat_result, rec.user_spec = pytree.tree_flatten_with_path(result)
        rec.user_constants, rec.user_from_slot = [], []
        for path, leaf in flat_result:
            if isinstance(leaf, (torch.Tensor, torch.SymFloat, torch.SymInt, torch.SymBool)):
                if isinstance(leaf, torch.Tensor):
                    leaf = leaf.detach()
                emit(Slot(Role.USER_OUTPUT, _keystr(path)), leaf)
                rec.user_constants.append(None)
                rec.user_from_slot.append(True)
            else:
                held = _tensor_inside(leaf)
                if held is not None:
                    raise _tensor_in_opaque_output(fn, _keystr(path), leaf, held)
                rec.user_constants.append(leaf)
                rec.user_from_slot.append(False)
        return tuple(outs)

    return forward


def _tensor_inside(value: Any, depth: int = 6) -> str | None:
    """Where a tensor sits inside an object that pytree does not flatten
    (``.layers[0].keys``), or None: such an output would be returned as a
    constant holding the trace's stand-in tensors."""
    seen: set[int] = set()

    def walk(x: Any, where: str, left: int) -> str | None:
        if isinstance(x, torch.Tensor):
            return where
        if left == 0 or id(x) in seen or isinstance(x, (str, bytes, int, float, bool, type(None), type)):
            return None
        if isinstance(x, (torch.nn.Module, torch.optim.Optimizer)):  # the user's own objects, returned as they are
            return None
        seen.add(id(x))
        if isinstance(x, Mapping):
            items = ((f"[{k!r}]", v) for k, v in x.items())
        elif isinstance(x, (list, tuple, set, frozenset)):
            items = ((f"[{i}]", v) for i, v in enumerate(x))
        elif dataclasses.is_dataclass(x):  # (fields, also where it has __slots__ and no __dict__)
            items = ((f".{f.name}", getattr(x, f.name, None)) for f in dataclasses.fields(x))
        elif hasattr(x, "__dict__"):
            items = ((f".{k}", v) for k, v in vars(x).items() if not callable(v))
        else:
            return None
        for suffix, v in items:
            found = walk(v, where + suffix, left - 1)
            if found is not None:
                return found
        return None

    return walk(value, "", depth)


def _tensor_in_opaque_output(fn: Callable, path: str, value: Any, held: str) -> CaptureError:
    code = getattr(fn, "__code__", None)
    source = format_frame(code.co_filename, code.co_firstlineno, code.co_name) if code is not None else None
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    return CaptureError(
        f"the step returns a {kind} at {path} that holds tensors ({path}{held}), and stepfx cannot follow tensors "
        "inside an object that torch.utils._pytree does not flatten: it would come back holding the capture's "
        "stand-ins",
        source=source,
        hint=("return the tensors themselves, or tuples, lists or dicts of them; a Hugging Face model's key/value "
              "cache: call it with use_cache=False, or leave the cache out of what the step returns"),
    )


def _no_fake_kernel(op: Any, exc: BaseException) -> CaptureError:
    """The error for an op that has neither a meta nor a fake kernel (fake
    mode reports it as data-dependent output or as unsupported)."""
    return CaptureError(
        f"operator {op} has no fake (meta) kernel, so stepfx cannot trace it without running it",
        source=user_frame_from_traceback(exc.__traceback__),
        hint="compute it outside the step, or register a fake kernel for it (torch.library.register_fake)",
    )


def capture_step(
    fn: Callable,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    args: tuple,
    kwargs: dict,
    inputs: StepInputs | None = None,
    options: CaptureOptions = CaptureOptions(),
    dynamic_dims: Mapping[str, frozenset[int]] | None = None,
) -> StepGraph:
    """Trace ``fn(model, optimizer, *args, **kwargs)`` into one StepGraph.

    The returned graph still contains the in-place updates the optimizer and
    modules perform (``functional=False``); its outputs are the final values
    of every parameter, buffer, remaining gradient and optimizer state, then
    the leaves of what ``fn`` returned.

    ``dynamic_dims`` (batch slot name -> dimensions) makes those sizes of
    the batch tensors symbolic (``capture/dynamic.py``); the signature's
    ``extra[DYNAMIC_KEY]`` records them.
    """
    if inputs is None:
        inputs = collect_inputs(model, optimizer, args, kwargs, options=options)
    rec = _Recorder()
    reads = BatchReads()
    traced = _make_traced_fn(fn, model, optimizer, inputs, rec, options, reads)
    fake_mode = compat.make_fake_mode()
    dynamic_dims = {k: v for k, v in (dynamic_dims or {}).items() if v}
    if dynamic_dims:
        compat.note_guard_sources(compat.shape_env_of(fake_mode), innermost_user_frame)
    fake_args = tuple(
        compat.fake_with_symbolic_dims(fake_mode, v, dynamic_dims[slot.name], _symbol_source(slot.name))
        if slot.role is Role.BATCH and slot.name in dynamic_dims else _fake_input(fake_mode, v)
        for slot, v in zip(inputs.slots, inputs.values)
    )

    # host random draws would be baked in as constants, a scheduler stepped inside would run once: both refused
    # (host_random.py, host_objects.py; so is a GradScaler, whose skipping the host decides)
    with _CAPTURE_LOCK, _preserved_rng(), refuse_host_random(), refuse_host_objects(optimizer), \
            watch_tracing_checks() as tracing_checks:
        try:
            gm = compat.trace_step_function(traced, fake_args, SYMBOLIC_DECOMPOSITIONS if dynamic_dims else None)
        except CaptureError:
            raise
        except compat.data_dependent_errors() as exc:
            if (op := compat.op_without_fake_kernel(exc)) is not None:
                raise _no_fake_kernel(op, exc) from exc
            hint = "express the choice with tensor ops (torch.where, masking) or move it out of the step"
            if (library := library_of_traceback(exc.__traceback__)) is not None:
                package, own = library
                example = (" (transformers' classification heads branch on the labels unless config.problem_type "
                           "is set)" if package == "transformers" else "")
                hint = (f"the line is in the installed package {package!r}, not your code"
                        + (f" (reached from {own})" if own else "")
                        + f": look for an option of it that takes another path{example}, or " + hint)
            if options.compute_dtype is torch.float16 and "float16" in innermost_user_line(exc.__traceback__):
                # transformers' encoder layers (BART, mBART, Marian, Pegasus, Whisper, ...) clamp fp16 overflow so
                hint = ("the branch is taken only under fp16 (it looks for fp16 overflow in the values): with bf16 "
                        '("bf16": {"enabled": true}) the model skips it'
                        + (f" (the line is in the installed package {library[0]!r}"
                           + (f", reached from {library[1]})" if library[1] else ")") if library else ""))
            raise CaptureError(
                "Python code reads a tensor's value (tensor-dependent control flow, .item()/.tolist() used in Python, or a data-dependent shape)",
                source=user_frame_from_traceback(exc.__traceback__),
                hint=hint,
                detail=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            ) from exc
        except compat.unsupported_operator_error() as exc:
            if (op := compat.op_without_fake_kernel(exc)) is not None:
                raise _no_fake_kernel(op, exc) from exc
            raise CaptureError(
                f"operator {getattr(exc, 'func', exc)} cannot be traced with fake tensors",
                source=user_frame_from_traceback(exc.__traceback__),
                hint="replace the op with a supported one or move it out of the step",
            ) from exc
        except Exception as exc:
            if compat.is_untraced_tensor_error(exc):
                raise CaptureError(
                    "the step uses a tensor that is not a parameter, buffer, optimizer state or argument of the step "
                    "(a global, a closure variable or a module attribute that is not registered)",
                    source=user_frame_from_traceback(exc.__traceback__),
                    hint="register it on the module (register_buffer) or pass it to the step as an argument",
                ) from exc
            if isinstance(exc, TypeError) and "unsupported format string passed to" in str(exc):
                raise CaptureError(
                    "the step formats a tensor's value as text (print or logging with a format spec): Python code in "
                    "the step runs once, while it is captured, when no values exist yet",
                    source=user_frame_from_traceback(exc.__traceback__),
                    hint="return the value from the step and format it after the call (loss = step(...); "
                         "print(f'{loss.item():.4f}')), or log at the config's steps_per_print",
                    detail=str(exc).strip().splitlines()[0],
                ) from exc
            raise CaptureError(
                f"the step raised {type(exc).__name__} while being traced",
                source=user_frame_from_traceback(exc.__traceback__),
                detail=str(exc).strip().splitlines()[0] if str(exc).strip() else None,
            ) from exc

    flatten_codegen(gm)
    signature = StepSignature(
        inputs=tuple(inputs.slots),
        outputs=tuple(rec.output_slots),
        user_output_spec=rec.user_spec,
        user_output_constants=tuple(rec.user_constants),
        user_output_from_slot=tuple(rec.user_from_slot),
    )
    if dynamic_dims:
        signature.extra[DYNAMIC_KEY] = dict(dynamic_dims)
    signature.extra[UNREAD_ARGUMENTS_KEY] = reads.unread()
    if tracing_checks:
        signature.extra[TRACING_CHECKS_KEY] = tuple(tracing_checks)
    if inputs.shared_step:
        signature.extra[SHARED_STEP_KEY] = True
    signature.extra[FROZEN_KEY] = frozenset(name for name, p in model.named_parameters() if not p.requires_grad)
    if optimizer is not None:
        signature.extra[UPDATE_RULES_KEY] = {
            name: update_rule_of(optimizer, optimizer.param_groups[g])
            for g, names in enumerate(inputs.group_params) for name in names
        }
    if options.buffers_cast:
        signature.extra[BUFFERS_CAST_KEY] = tuple(sorted(options.buffers_cast))
    if options.compute_dtype is not None and (kept := batch_norm_fp32_params(model)):
        signature.extra[FP32_PARAMS_KEY] = tuple(sorted(kept))
    graph = StepGraph(gm=gm, signature=signature, functional=False)
    annotate_step_graph(graph)
    check_mutations(graph)
    try:
        hint = "" if options.compute_dtype is None else _BUFFERS_HINT if options.cast_buffers else _BUFFERS_OFF_HINT
        check_operand_dtypes(graph, buffers_hint=hint)
    except BufferDtypeError as exc:
        # DeepSpeed holds every floating buffer in the compute dtype (module.bfloat16()): read these so, once
        written = [n for n in exc.buffers if _written(graph, n)]
        if not options.cast_buffers or options.compute_dtype is None or written \
                or set(exc.buffers) <= options.buffers_cast:
            if written and options.cast_buffers:
                raise BufferDtypeError(
                    exc.construct, exc.buffers, source=exc.source,
                    hint=f"the step writes {', '.join(written)}, so stepfx does not read a 16-bit copy in its place: "
                         "cast it in the step (buf.to(weight.dtype)) where it meets the weights") from None
            raise
        return capture_step(fn, model, optimizer, args, kwargs, inputs,
                            dataclasses.replace(options, buffers_cast=options.buffers_cast | set(exc.buffers)),
                            dynamic_dims)
    warn_python_only_reads(graph)
    return graph


UNREAD_ARGUMENTS_KEY = "unread_arguments"  # signature.extra: batch dict entries (no tensors) the step never fetched
BUFFERS_CAST_KEY = "buffers_cast"  # signature.extra: the floating buffers read in the compute dtype
FP32_PARAMS_KEY = "fp32_params"  # signature.extra: parameters read as fp32 under bf16/fp16 (batch norms)
_BUFFERS_HINT = ("stepfx already reads the buffer in the compute dtype and the operands still differ: cast the "
                 "operand in the step (x.to(weight.dtype)) where it meets the weights")
_BUFFERS_OFF_HINT = ('DeepSpeed holds buffers in the compute dtype (module.bfloat16()): leave stepfx.cast_buffers on '
                     '(true, the default) to read them so, or cast the buffer in the step (buf.to(weight.dtype))')


def _written(graph: StepGraph, name: str) -> bool:
    """Whether the captured step writes buffer ``name`` (in place or by replacing it)."""
    outputs = dict(zip(graph.signature.outputs, output_values(graph.gm)))
    placeholder = next((n for n in graph.gm.graph.nodes if n.op == "placeholder"
                        and (slot := n.meta.get(META_SLOT)) is not None and slot.role is Role.BUFFER
                        and slot.name == name), None)
    out = next((v for slot, v in outputs.items() if slot.role is Role.BUFFER and slot.name == name), placeholder)
    return out is not placeholder or any(mutation_base(arg) is placeholder for node in graph.gm.graph.nodes
                                         if node.op == "call_function" for arg in mutated_args(node))


def _symbol_source(name: str) -> str:
    """A Python identifier for a batch slot (guards name their inputs so)."""
    return "".join(c if c.isalnum() else "_" for c in name).strip("_") or "batch"


def _fake_input(fake_mode, value):
    if isinstance(value, TensorSpec):
        with fake_mode:
            return torch.empty(value.shape, dtype=value.dtype, device=value.device)
    return fake_mode.from_tensor(value.detach())


@contextlib.contextmanager
def _preserved_rng():
    """Tracing must not move the user's RNG streams."""
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def annotate_step_graph(graph: StepGraph) -> None:
    """Fill stepfx's node metadata from what tracing recorded: slots on
    placeholders (renamed after them), phase and user source on every node,
    owning parameter where a node belongs to one."""
    gm = graph.gm
    bind_placeholders(gm, graph.signature.inputs)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        # make_fx records ``val`` wherever an op produced a value; unused
        # optional outputs (a getitem of None) have none
        node.meta.setdefault("val", None)
        notes = dict(node.meta.get(compat.NODE_ANNOTATIONS) or {})
        phase = Phase(notes.get("phase", Phase.FORWARD.value))
        # kept in the annotations, so re-tracing passes carry them over
        notes["phase"] = phase.value
        node.meta[compat.NODE_ANNOTATIONS] = notes
        node.meta[META_PHASE] = phase
        node.meta[META_SOURCE] = notes.get("source")
        if "grad_of" in notes:
            node.meta[META_GRAD_OF] = notes["grad_of"]
    label_params(graph)
    gm.recompile()

"""The one place stepfx touches private torch (and Triton) APIs.

stepfx runs on torch 2.11 (GPU machines) and 2.13 (CI). Every private or
moving torch API it needs is wrapped here, so a torch upgrade changes this
file and nothing else; likewise the one private piece of Triton's
interpreter it patches (``patch_triton_language_once``). Each wrapper says what it wraps and why the public
API does not do the job.
"""
from __future__ import annotations

import copy

import contextlib
import functools
from typing import Any, Callable, Iterator

import sympy
import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

# ---------------------------------------------------------------------------
# Capture: tracing a whole step with make_fx over fake tensors.
# ---------------------------------------------------------------------------


def make_fake_mode():
    """A FakeTensorMode with static shapes that can represent scalars read
    out of tensors (``step.item()``, ``lr.item()``) as symbolic floats.

    Why: the optimizer computes its bias corrections and step sizes in Python
    from the step counter; with a plain fake mode those become constants of
    the first step. A ShapeEnv lets ``.item()`` produce an unbacked SymFloat
    whose Python arithmetic is recorded in the graph, so the graph computes
    the same double-precision scalars eager PyTorch computes, every step.
    ``FakeTensorMode`` and ``ShapeEnv`` are private.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    _fake_kernel_fixes()
    return FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True, allow_non_fake_inputs=False)


@functools.cache
def _fake_kernel_fixes() -> Any:
    """Fake kernels torch lacks or gets wrong for CPU, registered once per
    process through the public ``torch.library.register_fake`` (consulted
    before an op's meta kernel); the Library handed back keeps them.

    - ``aten._grouped_mm`` (Hugging Face MoE experts, ``grouped_mm``): torch's
      meta kernel demands bf16, as the CUDA kernel does, but the CPU kernel
      multiplies any one floating dtype (fp32 included) and returns a
      contiguous tensor. CPU inputs get that; others keep torch's meta
      kernel (``torch._meta_registrations.meta_grouped_mm``, private).
    - ``aten._ctc_loss.Tensor`` and its backward (``F.ctc_loss`` with length
      tensors, as Hugging Face's Wav2Vec2/HuBERT CTC heads call it) have no
      fake kernel at all. The loss is one value per sequence; ``log_alpha``
      (kept for the backward) is (batch, time, 2 * longest target + 1), the
      longest target read from ``target_lengths``: a data-dependent size,
      given as a fresh unbacked size (as ``nonzero``'s length). The
      backward's gradient has the log-probabilities' shape."""
    from torch._meta_registrations import meta_grouped_mm

    def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        if mat_a.device.type != "cpu":
            return meta_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
        torch._check(mat_a.dtype == mat_b.dtype and mat_a.is_floating_point(),
                     lambda: f"grouped_mm: expected one floating dtype, got {mat_a.dtype} and {mat_b.dtype}")
        torch._check(out_dtype is None or out_dtype == mat_a.dtype, lambda: f"grouped_mm: out_dtype {out_dtype} on CPU")
        if mat_a.dim() == 2 and mat_b.dim() == 2:  # a weight gradient: one product per group
            size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
        elif mat_a.dim() == 2:
            size = [mat_a.size(0), mat_b.size(-1)]
        elif mat_b.dim() == 2:
            size = [mat_a.size(1), mat_b.size(1)]
        else:
            size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
        return mat_a.new_empty(size)

    def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
        batched = log_probs.dim() == 3
        alpha_width = torch.library.get_ctx().new_dynamic_size(min=1)   # 2 * max(target_lengths) + 1
        nll = log_probs.new_empty((log_probs.size(1),) if batched else ())
        alpha = log_probs.new_empty((log_probs.size(1) if batched else 1, log_probs.size(0), alpha_width))
        return nll, alpha

    def ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank,
                          zero_infinity=False):
        return torch.empty_like(log_probs, memory_format=torch.contiguous_format)

    lib = torch.library.Library("aten", "FRAGMENT")
    try:
        torch.library.register_fake("aten::_grouped_mm", grouped_mm, lib=lib)
    except RuntimeError:
        # torch 2.11 registers that meta kernel in C++ (TORCH_LIBRARY), which
        # register_fake refuses to shadow: there CPU fp32 MoE experts keep
        # torch's bf16-only check (CUDA, where it is right, is unaffected)
        pass
    for name, kernel in (("aten::_ctc_loss.Tensor", ctc_loss), ("aten::_ctc_loss_backward.Tensor", ctc_loss_backward)):
        try:
            torch.library.register_fake(name, kernel, lib=lib)
        except RuntimeError:  # a torch that has its own fake kernel for it
            pass
    return lib


def trace_step_function(fn: Callable[..., Any], fake_args: tuple, decompositions: dict | None = None) -> fx.GraphModule:
    """make_fx ``fn`` over fake args, keeping node metadata annotations
    (``fx.traceback.annotate``; node-meta preservation is not stable API).
    Stack traces are not recorded: capture annotates each op with its user
    source line itself, at a fraction of the cost. ``decompositions``: ops
    traced as the given Python functions instead."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with fx_traceback.preserve_node_meta(), compiled_code_runs_eagerly():
        return make_fx(fn, decomposition_table=decompositions, tracing_mode="fake")(*fake_args)


def addmm_gelu_epilogue(bias: torch.Tensor, x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """``gelu(bias + x @ weight_t, approximate='tanh')`` with the GELU in the matmul's epilogue (cuBLASLt's
    ``CUBLASLT_EPILOGUE_GELU_BIAS``): ``torch._addmm_activation``, private in torch 2.11 and 2.13. CUDA only:
    on the CPU that function applies the erf GELU instead."""
    return torch._addmm_activation(bias, x, weight_t, use_gelu=True)


def compiled_code_runs_eagerly() -> contextlib.AbstractContextManager:
    """Code the user compiled with ``torch.compile`` (a compiled model held
    in a closure, a compiled loss function, a library's compiled kernel
    wrapper) runs as its Python while stepfx traces the step: make_fx cannot
    trace through a dynamo frame, and stepfx compiles the whole step itself.
    Dynamo's private ``error_on_nested_fx_trace`` (off: a compiled function
    under FX tracing runs its Python)."""
    import torch._dynamo

    if not hasattr(torch._dynamo.config, "error_on_nested_fx_trace"):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(error_on_nested_fx_trace=False)


def unwrapped_module(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside the wrappers a training script may already apply:
    ``torch.compile`` (stepfx compiles the whole step) and
    ``DistributedDataParallel``/``DataParallel`` (stepfx reduces the
    gradients itself; DDP's forward would also broadcast buffers and sample
    its logging with ``random``). Their parameters keep their own names,
    without ``_orig_mod.``/``module.``. ``OptimizedModule`` lives in the
    private ``torch._dynamo.eval_frame``."""
    from torch._dynamo.eval_frame import OptimizedModule

    while True:
        if isinstance(module, OptimizedModule):
            module = module._orig_mod
        elif isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            module = module.module
        else:
            return module


def refuse_fsdp_sharded(module: torch.nn.Module) -> None:
    """A model FSDP already sharded is refused: its parameters are flat
    shards or DTensors, not the model's (FSDP1's FullyShardedDataParallel,
    FSDP2's ``fully_shard`` classes named FSDP<class>)."""
    fsdp = [type(m).__name__ for m in module.modules()
            if type(m).__name__ == "FullyShardedDataParallel" or type(m).__name__.startswith("FSDP")]
    if fsdp:
        raise TypeError(
            f"the model holds {fsdp[0]} modules: FSDP already sharded its parameters, and stepfx shards the model "
            "itself (zero_optimization.stage 3 is FSDP's full sharding); pass the model before "
            "fully_shard/FullyShardedDataParallel")


def functionalize_graph_module(gm: fx.GraphModule, fake_args: tuple) -> fx.GraphModule:
    """Re-trace ``gm`` through torch's functionalization so in-place updates
    become out-of-place ops plus a ``copy_`` epilogue into the inputs; views
    stay views (``remove="mutations"``: materializing views as copies changes
    matmul layouts and so results). Running ``gm`` node by node through an
    Interpreter lets the re-trace copy each node's annotations and stack
    trace onto the nodes it produces."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def run(*args):
        return fx.Interpreter(gm).run(*args)

    with fx_traceback.preserve_node_meta():
        return make_fx(torch.func.functionalize(run, remove="mutations"), tracing_mode="fake")(*fake_args)


@contextlib.contextmanager
def annotate_nodes(annotation: dict) -> Iterator[None]:
    """Attach ``annotation`` to ``node.meta["custom"]`` of every node traced
    inside the block (``torch.fx.traceback.annotate``, not BC-guaranteed)."""
    annotate = getattr(fx_traceback, "annotate", None)
    if annotate is not None:
        with annotate(annotation):
            yield
        return
    saved = fx_traceback.current_meta.get("custom")
    fx_traceback.current_meta["custom"] = {**(saved or {}), **annotation}
    try:
        yield
    finally:
        if saved is None:
            fx_traceback.current_meta.pop("custom", None)
        else:
            fx_traceback.current_meta["custom"] = saved


NODE_ANNOTATIONS = "custom"  # the node.meta key annotate_nodes writes


def reparametrize_module(module: torch.nn.Module, tensors: dict) -> contextlib.AbstractContextManager:
    """Swap a module's parameters and buffers for ``tensors`` (by fully
    qualified name) for the duration of a block, keeping tied weights tied.
    What ``torch.func.functional_call`` does internally, as a context manager
    so the user's own step code (which calls the module itself) runs inside
    it. ``_reparametrize_module`` is private."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors, tie_weights=True, strict=False)


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """Exception types fake tracing raises when Python code needs a tensor's
    value (control flow on a tensor, data-dependent shapes)."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)


_RNN_LAYER_SCHEMA = (
    "mkldnn_rnn_layer(Tensor input, Tensor weight0, Tensor weight1, Tensor weight2, Tensor weight3, Tensor hx_, "
    "Tensor cx_, bool reverse, int[] batch_sizes, int mode, int hidden_size, int num_layers, bool has_biases, "
    "bool bidirectional, bool batch_first, bool train) -> (Tensor, Tensor, Tensor, Tensor)"
)


@functools.cache
def _grad_mode_twins() -> tuple[Any, dict]:
    """Ops whose CPU kernel looks at grad mode, each with a ``stepfx::`` twin
    that runs it with grad mode on (defined once per process; the Library
    handed back with the map keeps the definitions alive).

    ``aten.mkldnn_rnn_layer`` (nn.LSTM on CPU through oneDNN) writes the
    workspace its backward reads only when grad mode is on; a captured step
    runs under ``no_grad``, where the workspace comes back undefined and the
    captured ``mkldnn_rnn_layer_backward`` fails. The twin detaches its
    inputs, so grad mode records nothing; its fake kernel is aten's meta
    kernel. A ``torch.library.Library`` op costs ~25 us a call over the
    aten op (``torch.library.custom_op``'s wrapper ~100 us); both are
    public, the op it wraps is not."""
    aten = torch.ops.aten

    def rnn_layer(*args):
        detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        with torch.enable_grad():
            return aten.mkldnn_rnn_layer.default(*detached)

    lib = torch.library.Library("stepfx", "FRAGMENT")
    lib.define(_RNN_LAYER_SCHEMA)
    lib.impl("mkldnn_rnn_layer", rnn_layer, "CompositeExplicitAutograd")
    torch.library.register_fake("stepfx::mkldnn_rnn_layer", lambda *args: aten.mkldnn_rnn_layer.default(*args), lib=lib)
    return lib, {aten.mkldnn_rnn_layer.default: torch.ops.stepfx.mkldnn_rnn_layer.default}


def grad_mode_twin(func: Any) -> Any:
    """The op capture records in place of ``func``: its grad-mode twin
    (``_grad_mode_twins``) or ``func`` itself."""
    return _grad_mode_twins()[1].get(func, func)


def op_without_fake_kernel(exc: BaseException) -> Any:
    """The op a fake-tracing error is about when that op has neither a meta
    kernel nor a registered fake kernel (``F.ctc_loss``'s ``_ctc_loss.Tensor``):
    fake mode then reports it as a data-dependent output or an unsupported
    operator, which would misname the cause. None otherwise."""
    import torch._library.simple_registry as registry

    op = getattr(exc, "func", None)
    if not isinstance(op, torch._ops.OpOverload):
        return None
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"):
        return None
    if registry.singleton.find(op.name()).fake_impl.kernel is not None:
        return None
    return op


def unsupported_operator_error() -> type[BaseException]:
    from torch._subclasses.fake_tensor import UnsupportedOperatorException

    return UnsupportedOperatorException


def is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def rename_node(node: fx.Node, name: str) -> None:
    """Rename a node (a placeholder's target too) through the graph's
    namespace, which keeps names unique. ``Node._rename`` is private."""
    node._rename(name)
    if node.op == "placeholder":
        node.target = node.name


def is_untraced_tensor_error(exc: BaseException) -> bool:
    """True when fake tracing met a real tensor it was not given as an input
    (a global, a closure variable, an unregistered module attribute). Fake
    mode reports it as an AssertionError whose text is the only marker."""
    return isinstance(exc, AssertionError) and "convert all Tensors to FakeTensors" in str(exc)


def dispatch_mode_base() -> type:
    """``TorchDispatchMode`` (lives in the private ``torch.utils._python_dispatch``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


# --------------------------------------------------------------------------
# Threaded process group (stepfx.testing.run_threaded)
#
# torch's in-process "threaded" backend runs each rank in a thread of one
# process, so unit tests of collective code cost milliseconds instead of
# seconds of process start-up. It lives in torch.testing._internal and has no
# public equivalent. Importing multi_threaded_pg registers the "threaded"
# backend; it does not need `expecttest` (common_distributed, which we avoid,
# does). Imports are inside the functions so that importing stepfx.compat
# does not import torch's testing internals.


def install_threaded_pg() -> None:
    """Make torch.distributed's world state thread-local, so each thread is one rank.

    Wraps multi_threaded_pg._install_threaded_pg (also registers the
    "threaded" backend on import) and turns on c10d's thread isolation, which
    makes the C++ group-name registry (used by _c10d_functional ops to find a
    group) per thread. Undo with uninstall_threaded_pg.
    """
    import torch
    from torch.testing._internal.distributed import multi_threaded_pg

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    world = multi_threaded_pg._install_threaded_pg()
    if not hasattr(world, "comms"):
        # torch 2.11's ThreadLocalWorld lacks the `comms` list that its
        # destroy_process_group reads (2.13 has it). Threaded groups have no
        # torchcomms communicators, so an empty list is exact.
        world.comms = []


def uninstall_threaded_pg() -> None:
    """Restore the process-wide torch.distributed world and clear the threaded backend's state.

    Wraps ProcessLocalGroup.reset (forgets pending collectives and the abort
    flag), multi_threaded_pg._uninstall_threaded_pg and c10d's thread isolation.
    """
    import torch
    from torch.testing._internal.distributed import multi_threaded_pg

    multi_threaded_pg.ProcessLocalGroup.reset()
    multi_threaded_pg._uninstall_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(False)


def threaded_pg_installed() -> bool:
    """Whether install_threaded_pg is in effect (it is not reentrant).

    Checks torch.distributed.distributed_c10d._world, the private global the
    threaded backend swaps out.
    """
    import torch
    from torch.testing._internal.distributed import multi_threaded_pg

    return isinstance(torch.distributed.distributed_c10d._world, multi_threaded_pg.ThreadLocalWorld)


def abort_threaded_collectives(exc: BaseException) -> None:
    """Wake every thread waiting in a threaded-backend collective; they raise SystemExit.

    Wraps ProcessLocalGroup.exception_handle: without it, ranks waiting for a
    rank that failed would wait forever.
    """
    from torch.testing._internal.distributed import multi_threaded_pg

    multi_threaded_pg.ProcessLocalGroup.exception_handle(exc)


def copy_graph(dst: fx.Graph, src: fx.Graph, val_map: dict) -> Any:
    """``dst.graph_copy(src, val_map)``: every node of ``src`` appended to
    the empty graph ``dst`` (names, metadata copied shallowly, ``val_map``
    filled), returning the output's value mapped. Without
    ``Graph.create_node``'s scan of every node's arguments for raw SymInts
    that torch 2.13 added (a warning only; the copied nodes passed it when
    they were made): 60% of a copy's time, and passes copy their graph
    before they edit it. Graph's node bookkeeping is private: where it is
    not as expected, the public ``graph_copy``."""
    needed = ("_graph_namespace", "_insert", "_find_nodes_lookup_table", "_len")
    if not all(hasattr(dst, a) for a in needed) or dst._len or dst.owning_module is not None:
        return dst.graph_copy(src, val_map)
    names, insert, table = dst._graph_namespace, dst._insert, dst._find_nodes_lookup_table
    lookup = val_map.__getitem__
    map_arg = fx.node.map_arg
    for node in src.nodes:
        if node in val_map:
            continue
        if node.op == "output":
            return map_arg(node.args[0], lookup)
        name = names.create_name(node.name, None)
        new = fx.Node(dst, name, node.op, node.target, map_arg(node.args, lookup), map_arg(node.kwargs, lookup),
                      node.type)
        names.associate_name_with_obj(name, new)
        insert(new)
        table.insert(new)
        dst._len += 1
        new.meta = copy.copy(node.meta)
        val_map[node] = new
    return None


def graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule whose Python code is generated on first call, not on
    construction or ``recompile()``: passes build many intermediate graphs
    that are printed or rewritten but never run, and code generation costs
    ~50 us per node. ``_LazyGraphModule`` is private; plain GraphModule
    where it is missing."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover - older torch
        return fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)



def compile_region(gm: fx.GraphModule, dynamic: bool = False) -> Callable[..., Any]:
    """``gm`` (aten ops, positional tensor inputs, a tuple out) compiled by
    inductor.

    Static shapes: inductor's ``compile_fx`` (private) on the first call's
    inputs, called directly afterwards. A region's key holds its inputs'
    shapes and strides, so it never sees others; and ``torch.compile``'s
    frame guards cost ~60 us a call against ~8 us direct (measured on CPU,
    torch 2.13, a three-op region) — 13-22 ms of host time a step across
    the 200-370 regions of a 1B Hugging Face model, on a step the host
    already has trouble keeping ahead of the GPU. Symbolic shapes (a region
    of a step with symbolic batch sizes): the public ``torch.compile``,
    one graph (``fullgraph``), compiled once for all sizes."""
    if dynamic:
        return torch.compile(gm, backend="inductor", fullgraph=True, dynamic=True)
    return _DirectInductor(gm)


class _DirectInductor:
    """A static-shape region compiled by inductor at its first call."""

    def __init__(self, gm: fx.GraphModule):
        # inductor's passes may rewrite the module they are given: it gets a copy
        self.gm = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        self.fn = None

    def __call__(self, *args):
        if self.fn is None:
            from torch._guards import TracingContext, tracing
            from torch._inductor.compile_fx import compile_fx

            # compiled over fake copies of the inputs in a tracing context, as dynamo
            # hands graphs to inductor: without a ShapeEnv inductor bypasses its FX
            # graph cache ("No shape env") and generates every region's code again in
            # each process (measured on CPU, torch 2.13: a warm start's 14 Llama
            # regions took 10.6 s in compile_fx, 0.75 s each)
            mode = make_fake_mode()
            fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            with torch.no_grad(), tracing(TracingContext(mode)):
                self.fn = compile_fx(self.gm, fakes)
        return tuple(self.fn(*args))


# --------------------------------------------------------------------------
# Triton's interpreter (TRITON_INTERPRET=1: kernels on the CPU, for tests)


def patch_triton_language_once() -> None:
    """Make the Triton interpreter set up ``triton.language`` once per
    process instead of on every launch.

    Wraps ``triton.runtime.interpreter._patch_lang`` (private; Triton 3.6 and
    later as installed here), which every launch and every call of a
    ``@triton.jit`` helper from inside a kernel runs: it walks
    ``triton.language``, ``.core``, ``.math`` and ``tensor`` with
    ``inspect.getmembers`` and wraps each builtin to run on NumPy, ~2 ms a
    call, and the helpers' calls never undo it. stepfx's kernels call
    helpers per block, so on the CPU this set-up was ~15% of a codegen
    step's time. Here the first call patches and keeps the patches (the
    scope handed back has nothing to undo); later calls find the language
    patched. Under the interpreter no kernel is compiled, so nothing needs
    the unpatched language back. Only call it when interpreting."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - triton is a dependency
        return
    if getattr(interpreter, "_stepfx_patched_once", False) or not hasattr(interpreter, "_LangPatchScope"):
        return
    original = interpreter._patch_lang
    patched: set[frozenset] = set()

    def patch_lang(fn):
        key = frozenset(id(v) for v in fn.__globals__.values() if v is interpreter.tl or v is interpreter.tl.core)
        if key not in patched:
            original(fn)
            patched.add(key)
        return interpreter._LangPatchScope()

    interpreter._patch_lang = patch_lang
    interpreter._stepfx_patched_once = True
    _round_bf16_to_nearest(interpreter)


def _round_bf16_to_nearest(interpreter) -> None:
    """Make the interpreter's fp32 -> bf16 casts round to nearest even, as
    the GPU's do.

    Wraps ``InterpreterBuilder.cast_impl`` (private, Triton 3.6): it
    converts fp32 to bf16 by dropping the low mantissa bits (``_convert_float``
    without a rounding mode), i.e. rounds toward zero. Measured 2026-12-06:
    a LayerNorm kernel's bf16 output had twice aten's error against fp32
    (3.3e-3 vs 1.7e-3 normwise) and its statistics were biased low (rstd
    50.25 where 50.38 rounds to 50.5), so CPU tests of bf16 kernels saw
    errors the GPU does not make (an OPT step drifted 15% from the
    reference in 5 AdamW steps, 4% with the LayerNorm kernels off). torch's
    own conversion rounds to nearest even, as CUDA does."""
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or getattr(builder, "_stepfx_bf16_rounding", False):
        return
    import numpy as np

    original = builder.cast_impl
    tl = interpreter.tl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl
    builder._stepfx_bf16_rounding = True


# ---------------------------------------------------------------------------
# Symbolic batch sizes (stepfx.dynamic)
# ---------------------------------------------------------------------------


def fake_with_symbolic_dims(fake_mode, tensor: torch.Tensor, dims, name: str):
    """A fake copy of ``tensor`` whose dimensions ``dims`` are symbolic sizes
    (SymInts of the mode's ShapeEnv, named after ``name`` in guards).

    Why private: ``FakeTensorMode.from_tensor`` with a ``symbolic_context`` is
    how dynamo and export make dynamic inputs; ``StatelessSymbolicContext``,
    ``DimDynamic`` and the ``LocalSource`` that names the input in guards are
    in private modules. Sizes 0 and 1 are specialized by the ShapeEnv (as in
    torch.compile): such a dimension comes back as a plain int."""
    from torch._dynamo.source import LocalSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    sizes = [DimDynamic.DUCK if i in dims else DimDynamic.STATIC for i in range(tensor.dim())]
    context = StatelessSymbolicContext(dynamic_sizes=sizes)
    return fake_mode.from_tensor(tensor.detach(), static_shapes=False, source=LocalSource(name),
                                 symbolic_context=context)


def shape_env_of(fake_mode):
    """The ShapeEnv behind ``fake_mode`` (``FakeTensorMode.shape_env``)."""
    return fake_mode.shape_env


def guard_code(shape_env, placeholders) -> str | None:
    """One Python expression over ``placeholders``' real counterparts that
    is true when a call's sizes satisfy every guard the trace recorded
    (sizes the graph specialized on, equalities between sizes, the ranges
    symbolic sizes were assumed in), static dimensions included. None when
    there is nothing to check. Wraps ``ShapeEnv.produce_guards_expression``."""
    return shape_env.produce_guards_expression(list(placeholders), ignore_static=False)


def evaluate_guard_code(shape_env, code: str, args) -> bool:
    """``guard_code``'s expression evaluated on real tensors
    (``ShapeEnv.evaluate_guards_expression``)."""
    return bool(shape_env.evaluate_guards_expression(code, list(args)))


class _GuardList(list):
    """``ShapeEnv.guards`` that notes, as each guard is added, where the
    user's code was (``where()``)."""

    def __init__(self, items, where: Callable[[], str | None]):
        super().__init__(items)
        self.where = where
        self.sources: dict[int, str | None] = {}

    def append(self, guard) -> None:
        self.sources[id(guard)] = self.where()
        super().append(guard)


def note_guard_sources(shape_env, where: Callable[[], str | None]) -> None:
    """From now on, remember ``where()`` (the user's source line) for each
    guard ``shape_env`` records. ``ShapeEnv.guards`` is a private list that
    torch appends to when a guard is made; stepfx swaps in a list that
    notes the caller (torch keeps only its own frame, or dynamo's user
    stack, which make_fx has not)."""
    if isinstance(getattr(shape_env, "guards", None), list):
        shape_env.guards = _GuardList(shape_env.guards, where)


def recorded_guards(shape_env) -> list[tuple[str, str | None]]:
    """``(expression, where)`` of each guard recorded on symbolic sizes,
    ``where`` being the user's line noted by ``note_guard_sources`` (or
    torch's own note of the frame)."""
    out = []
    guards = getattr(shape_env, "guards", [])
    sources = getattr(guards, "sources", {})
    for g in guards:
        where = sources.get(id(g))
        sloc = getattr(g, "sloc", None)
        if where is None and sloc is not None:
            where = getattr(sloc, "maybe_user_loc", None) or getattr(sloc, "framework_loc", None)
            where = str(where) if where else None
        out.append((str(g.expr), where))
    return out


def is_symbolic(value: Any) -> bool:
    """A SymInt/SymFloat/SymBool that is not a known constant."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    if isinstance(value, torch.SymInt):
        return not is_concrete_int(value)
    return isinstance(value, (torch.SymFloat, torch.SymBool))


def size_expr(value: Any):
    """The sympy expression of a size (an int for a static one).
    ``SymInt.node.expr`` is private."""
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return int(value)


def unbacked_symbols_bound(node: fx.Node) -> set:
    """The data-dependent (unbacked) size symbols ``node``'s output
    introduces (``nonzero``'s length, ``ctc_loss``'s longest target).
    ``meta["unbacked_bindings"]`` is make_fx's private record."""
    return set((node.meta.get("unbacked_bindings") or {}).keys())


def symbol_values(shape_env, symbols) -> dict:
    """A value for each symbol, for sizing what a graph holds: the size
    seen when the step was traced (a backed size's hint), or for a
    data-dependent size (an unbacked symbol: ``nonzero``'s length) the
    upper bound torch knows (``ShapeEnv.var_to_range``; None when it has
    none). ``var_to_val`` and ``var_to_range`` are private."""
    out = {}
    backed = getattr(shape_env, "backed_var_to_val", None)  # torch 2.13's name for var_to_val
    hints = backed if backed is not None else shape_env.var_to_val
    for sym in symbols:
        value = hints.get(sym)
        if value is None:
            bound = shape_env.var_to_range.get(sym)
            upper = getattr(bound, "upper", None)
            # torch's int_oo says is_finite; only a sympy Integer is a bound
            value = upper if isinstance(upper, (int, sympy.Integer)) else None
        out[sym] = None if value is None else int(value)
    return out


def size_hint(size) -> int:
    """The concrete value behind a size: a symbolic one's hint (the size of
    the call being traced), a static one itself."""
    return _hint(size)


def _hint(size) -> int:
    """The concrete value behind a size (a symbolic one's hint: the size of
    the call being traced). ``SymNode.hint`` is private."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint if hint is not None else size.node.shape_env.size_hint(size.node.expr))
    return int(size)


def linear_with_symbolic_sizes(input, weight, bias=None):
    """``F.linear`` on inputs with symbolic sizes as the ops eager's
    ``at::native::linear`` runs, or None where this does not apply (then the
    caller runs torch's own).

    Why: measured on torch 2.11 (CUDA, bf16), the C++ composite reads the
    input's sizes as plain ints (``aten.size.default``), and fake tensors
    answer that by specializing every size (guards ``batch == 3``,
    ``length == 33`` at the first ``nn.Linear``), so a step captured with
    symbolic lengths would serve one length only. The ops are the ones the
    composite picks for dense strided inputs on every version stepfx
    supports: a 2-D input with a bias is ``addmm``; a contiguous 3-D input
    with a 1-D bias is flattened into ``addmm`` (the fused bias epilogue);
    without a bias, ``matmul``'s fold of the leading dimensions into one
    ``mm``. Other cases (4-D+ with a bias, non-contiguous inputs, sparse
    weights) return None: their op choice differs between versions."""
    if not isinstance(input, torch.Tensor) or not any(isinstance(s, torch.SymInt) for s in input.shape):
        return None
    if input.layout != torch.strided or weight.layout != torch.strided or weight.dim() != 2 or input.dim() < 2:
        return None
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dim() != 1):
        return None
    if input.dim() == 2:
        return torch.addmm(bias, input, weight.t()) if bias is not None else torch.mm(input, weight.t())
    if not input.is_contiguous() or (bias is not None and input.dim() != 3):
        return None
    lead = input.shape[:-1]
    rows = 1
    for size in lead:
        rows = rows * size
    flat = input.reshape(rows, input.shape[-1])
    out = torch.addmm(bias, flat, weight.t()) if bias is not None else torch.mm(flat, weight.t())
    return out.view(*lead, out.shape[1])


def matmul_with_symbolic_sizes(input, other):
    """``torch.matmul`` of two batched matrices (both at least 3-D, the
    same batch sizes) with symbolic sizes, as the ops matmul runs for them
    (the batch folded into one, ``bmm``, the batch unfolded), or None where
    this does not apply (then the caller runs torch's own).

    Why: measured on the GPU machine (torch 2.11, 2026-12-06), the C++
    composite reads the sizes as plain ints, and fake tensors answer that by
    specializing them: Hugging Face's rotary embedding
    (``inv_freq_expanded @ position_ids_expanded``, [B, D/2, 1] @ [B, 1, L])
    put a guard ``Eq(length, 83)`` on every Llama-family step, which was then
    captured again for every new length. Operands with broadcast batch
    dimensions or fewer dimensions take other paths in the composite (a fold
    into one ``mm``) and return None here."""
    if not (isinstance(input, torch.Tensor) and isinstance(other, torch.Tensor)) or input.dim() < 3 or other.dim() < 3:
        return None
    if not any(isinstance(s, torch.SymInt) for t in (input, other) for s in t.shape):
        return None
    batch = input.shape[:-2]
    if len(batch) != other.dim() - 2 or any(size_expr(a) != size_expr(b) for a, b in zip(batch, other.shape[:-2])):
        return None
    n, m, p = input.shape[-2], input.shape[-1], other.shape[-1]
    rows = 1
    for size in batch:
        rows = rows * size
    return torch.bmm(input.reshape(rows, n, m), other.reshape(rows, m, p)).view(*batch, n, p)


def sdpa_with_symbolic_sizes(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                             enable_gqa=False):
    """``F.scaled_dot_product_attention`` on CUDA tensors with symbolic
    sizes, as the fused kernel eager would pick, or None where this does
    not apply (then the caller runs torch's own).

    Why: on CUDA the composite picks its kernel in C++ reading the inputs'
    sizes as plain ints, and fake tensors answer that by specializing every
    size (measured on torch 2.11: a guard ``batch == 3``, ``length == 33``
    per attention), so the step would serve one length only. Here the
    choice is made the way eager makes it (``torch._fused_sdp_choice``, a
    private op) on empty CUDA tensors of the traced call's sizes, outside
    the trace (``_disable_current_modes``, private), and that kernel's op is
    called on the traced inputs: its meta kernel keeps sizes symbolic.
    Applies to flash, cuDNN and memory-efficient attention: no grouped-query
    expansion, head dims the kernels take unpadded (multiples of 8). A mask
    is handed over as the composite hands it (``attention_mask_for``)."""
    from torch.nn.attention import SDPBackend
    from torch.utils._python_dispatch import _disable_current_modes

    tensors = [t for t in (query, key, value, attn_mask) if isinstance(t, torch.Tensor)]
    if query.device.type != "cuda" or enable_gqa or query.dim() != 4 or _hint(query.shape[-1]) % 8:
        return None
    if not any(isinstance(s, torch.SymInt) for t in tensors for s in t.shape):
        return None
    with _disable_current_modes():
        real = [torch.empty_strided([_hint(s) for s in t.shape], [_hint(s) for s in t.stride()], dtype=t.dtype,
                                    device=t.device).requires_grad_(t.requires_grad) for t in tensors]
        mask = real[3] if attn_mask is not None else None
        choice = torch._fused_sdp_choice(real[0], real[1], real[2], mask, dropout_p, is_causal, scale=scale)
        del real, mask
    aten = torch.ops.aten
    grad = any(t.requires_grad for t in (query, key, value))
    if choice == int(SDPBackend.FLASH_ATTENTION) and attn_mask is None:
        return aten._scaled_dot_product_flash_attention.default(query, key, value, dropout_p, is_causal, False,
                                                                scale=scale)[0]
    if choice == int(SDPBackend.EFFICIENT_ATTENTION):
        mask = attention_mask_for("efficient", attn_mask, query, key)
        return aten._scaled_dot_product_efficient_attention.default(query, key, value, mask, grad, dropout_p,
                                                                    is_causal, scale=scale)[0]
    if choice == int(SDPBackend.CUDNN_ATTENTION):
        mask = attention_mask_for("cudnn", attn_mask, query, key)
        return aten._scaled_dot_product_cudnn_attention.default(query, key, value, mask, grad, dropout_p,
                                                                is_causal, False, scale=scale)[0]
    return None


# memory-efficient attention reads its bias in rows of a multiple of this many elements
_EFFICIENT_BIAS_ALIGNMENT = 8


def attention_mask_for(kernel: str, attn_mask, query, key):
    """The mask the SDPA composite hands the ``kernel`` ("cudnn" or
    "efficient") for the user's ``attn_mask`` (None stays None).

    As torch's composite does on every version stepfx supports: a boolean
    mask (True: attend) becomes additive in the query's dtype, 0 where
    True and a large negative where False (-inf; for cuDNN -65504, which
    its kernel needs instead of -inf); for memory-efficient attention the
    mask's rows are padded to a multiple of 8 elements and cut back (the
    kernel's alignment; a view of the padded tensor) and it is expanded to
    [batch, heads, query length, key length]. The composite pads only a
    mask that is not aligned already; here it always pads (the same values
    read, the alignment test being a guard on the symbolic length
    otherwise). Without this the kernels refuse a boolean mask ("invalid
    dtype for bias") at the first run."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        masked = -65504.0 if kernel == "cudnn" else float("-inf")
        zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=attn_mask.device)
        attn_mask = torch.where(attn_mask.logical_not(), masked, zero)
    if kernel == "efficient":
        # rows widened by 1 to 8 elements, written into zeros (the composite's pad; a pad of 1 to 8 would
        # guard on the pad's size being 1, a size that changes with the length)
        width = attn_mask.shape[-1]
        padded = width - width % _EFFICIENT_BIAS_ALIGNMENT + _EFFICIENT_BIAS_ALIGNMENT
        wide = attn_mask.new_zeros([*attn_mask.shape[:-1], padded])
        attn_mask = torch.slice_scatter(wide, attn_mask, dim=-1, start=0, end=width)[..., :width]
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    return attn_mask


_GROUPED_KV: dict = {}


def attention_ops_taking_grouped_kv(device: torch.device) -> frozenset:
    """The SDPA kernel ops (forward and backward) that take fewer key/value
    heads than query heads on ``device``, as ``enable_gqa`` gives them.

    CPU: the flash kernel (torch's own SDPA passes it grouped heads). CUDA:
    cuDNN's and flash attention's, each kept only if a probe on this device
    — forward and backward on small bf16 tensors, 8 query heads over 2
    key/value heads — runs and equals the repeated computation (outputs and
    gradients within bf16 rounding), since torch versions differ in what
    their kernels take. Probed once per device and process."""
    aten = torch.ops.aten
    if device.type == "cpu":
        return frozenset({aten._scaled_dot_product_flash_attention_for_cpu.default,
                          aten._scaled_dot_product_flash_attention_for_cpu_backward.default})
    if device.type != "cuda":
        return frozenset()
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    if key not in _GROUPED_KV:
        _GROUPED_KV[key] = _probe_grouped_kv(torch.device("cuda", key[1]))
    return _GROUPED_KV[key]


def _probe_grouped_kv(device: torch.device) -> frozenset:
    aten = torch.ops.aten
    candidates = {
        "cudnn": (aten._scaled_dot_product_cudnn_attention.default,
                  aten._scaled_dot_product_cudnn_attention_backward.default),
        "flash": (aten._scaled_dot_product_flash_attention.default,
                  aten._scaled_dot_product_flash_attention_backward.default),
    }
    g = torch.Generator(device=device).manual_seed(0)
    b, h, hkv, s, d = 1, 8, 2, 128, 64
    q = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, hkv, s, d, device=device, dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, hkv, s, d, device=device, dtype=torch.bfloat16, generator=g)
    dy = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, generator=g)
    rep = lambda t: t.repeat_interleave(h // hkv, dim=1)  # noqa: E731
    out = set()
    for name, (fwd, bwd) in candidates.items():
        try:
            grads = []
            for kk, vv in ((rep(k), rep(v)), (k, v)):
                if name == "cudnn":
                    o, lse, cq, ck, mq, mk, seed, offset, _ = fwd(q, kk, vv, None, True, 0.0, True, False, scale=0.125)
                    dq, dk, dv = bwd(dy, q, kk, vv, o, lse, seed, offset, None, cq, ck, mq, mk, 0.0, True, scale=0.125)
                else:
                    o, lse, cq, ck, mq, mk, seed, offset, _ = fwd(q, kk, vv, 0.0, True, False, scale=0.125)
                    dq, dk, dv = bwd(dy, q, kk, vv, o, lse, cq, ck, mq, mk, 0.0, True, seed, offset, scale=0.125)
                if dk.shape[1] != kk.shape[1]:
                    raise ValueError("gradient heads")
                if kk.shape[1] == h:  # sum the copies' gradients back, as repeat_kv's backward does
                    dk, dv = (t.float().view(b, hkv, h // hkv, s, d).sum(2) for t in (dk, dv))
                grads.append([o.float(), dq.float(), dk.float(), dv.float()])
            if all(torch.allclose(x, y, rtol=2e-2, atol=2e-2) for x, y in zip(*grads)):
                out.update((fwd, bwd))
        except Exception:  # a kernel this torch or GPU cannot run with grouped heads: not listed
            continue
    return frozenset(out)


def flash_attention_takes(device: torch.device) -> Callable[..., bool] | None:
    """A predicate ``(dtype, head_dim, query_heads, kv_heads, is_causal) -> bool``:
    whether torch's flash attention kernel takes such a call on ``device``
    (CUDA only; None elsewhere). Asks torch's own dispatcher check
    (``torch.backends.cuda.can_use_flash_attention`` on small tensors of the
    call's dtype and head sizes: GPU architecture, head dim, dtype, whether
    flash is enabled), once per combination and process."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    index = device.index if device.index is not None else torch.cuda.current_device()
    dev = torch.device("cuda", index)

    def takes(dtype, head_dim: int, heads: int, kv_heads: int, is_causal: bool) -> bool:
        key = (index, dtype, head_dim, heads, kv_heads, is_causal)
        if key not in _FLASH_TAKES:
            try:
                q = torch.empty(1, heads, 128, head_dim, device=dev, dtype=dtype)
                kv = torch.empty(1, kv_heads, 128, head_dim, device=dev, dtype=dtype)
                _FLASH_TAKES[key] = bool(can_use_flash_attention(
                    SDPAParams(q, kv, kv, None, 0.0, is_causal, kv_heads != heads), False))
            except Exception:  # an SDPAParams this torch does not have: not taken
                _FLASH_TAKES[key] = False
        return _FLASH_TAKES[key]

    return takes


_FLASH_TAKES: dict = {}


def inductor_default_cache_dir() -> str:
    """Where inductor keeps its compiled artifacts when TORCHINDUCTOR_CACHE_DIR
    is not set (``/tmp/torchinductor_<user>``), without creating it.

    Wraps ``torch._inductor.runtime.cache_dir_utils.default_cache_dir``
    (private). The public-looking ``cache_dir()`` beside it creates the
    directory and writes TORCHINDUCTOR_CACHE_DIR into ``os.environ``: side
    effects a report must not have. The caller applies the variable itself."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


# ---------------------------------------------------------------------------
# The plan cache: step graphs with their fake-tensor metadata, on disk
# ---------------------------------------------------------------------------


class GraphsNotSerializable(Exception):
    """What :func:`dump_graphs` could not write (the plan is then not cached)."""


# node.meta entries not written: stacks of module and function objects,
# provenance chains of earlier graphs; nothing runs or explains a plan with them
_UNSAVED_META = frozenset({"nn_module_stack", "source_fn_stack", "fwd_source_fn_stack", "from_node"})


class _NodeRef:
    """A node's position in its graph, standing for the node in pickled arguments."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __reduce__(self):
        return (_NodeRef, (self.index,))


def _swap_nodes(value: Any, swap: Callable[[Any], Any], kind: type) -> Any:
    """``value`` (a node's args or kwargs) with every ``kind`` replaced by
    ``swap`` of it; the containers fx puts in args (tuples, lists, dicts,
    slices) are walked. A plain walk: pytree's costs ~3x as much on the
    thousands of nodes of a step graph."""
    if isinstance(value, kind):
        return swap(value)
    if isinstance(value, list):
        return [_swap_nodes(v, swap, kind) for v in value]
    if isinstance(value, tuple):
        items = [_swap_nodes(v, swap, kind) for v in value]
        if type(value) is tuple:
            return tuple(items)
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple; torch.Size
    if isinstance(value, dict):
        return {k: _swap_nodes(v, swap, kind) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(*(_swap_nodes(v, swap, kind) for v in (value.start, value.stop, value.step)))
    return value


def _rebuild_graph_module(state: dict, nodes: list) -> fx.GraphModule:
    gm = fx.GraphModule.__new__(fx.GraphModule)
    gm.__dict__ = state
    graph = fx.Graph(gm, state.get("_tracer_cls"), state.get("_tracer_extras"))
    made: list[fx.Node] = []

    def node_of(ref: _NodeRef) -> fx.Node:
        return made[ref.index]

    for op, name, target, args, kwargs, type_, meta in nodes:
        node = graph.create_node(op, target, _swap_nodes(args, node_of, _NodeRef), _swap_nodes(kwargs, node_of, _NodeRef),
                                 name, type_)
        node.meta = meta
        made.append(node)
    gm._graph = graph  # forward is generated by the first recompile() (the executor's)
    return gm


def _rebuild_sym(expr, shape_env, pytype: type, hint):
    from torch.fx.experimental.sym_node import SymNode

    return {int: torch.SymInt, float: torch.SymFloat, bool: torch.SymBool}[pytype](SymNode(expr, shape_env, pytype, hint))


@functools.cache
def _step_graph_pickler() -> type:
    """A ``torch.fx._graph_pickler.GraphPickler`` (private: what inductor's
    FX graph cache and its compile subprocesses use) that also writes what
    step graphs hold: nodes calling stepfx's own kernel functions (saved by
    reference, as pickle saves functions; GraphPickler takes aten ops and a
    few namespaces only), symbolic floats and booleans (the optimizer's
    ``lr.item()`` arithmetic), and at most one ShapeEnv (every symbolic
    value of a plan comes from its capture's: a second one would be merged
    into the first on loading)."""
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    class StepGraphPickler(GraphPickler):
        def __init__(self, file, options=None):
            super().__init__(file, options)
            self._shape_env = None

        def reducer_override(self, obj):
            if isinstance(obj, fx.GraphModule):
                obj.code  # a lazy GraphModule generates its code now, so the state holds it
                state = obj.__getstate__()
                state.pop("_graph", None)
                refs: dict[fx.Node, _NodeRef] = {}
                nodes = []
                for i, node in enumerate(obj.graph.nodes):
                    refs[node] = _NodeRef(i)
                    meta = {k: v for k, v in node.meta.items() if k not in _UNSAVED_META}
                    nodes.append((node.op, node.name, node.target, _swap_nodes(node.args, refs.__getitem__, fx.Node),
                                  _swap_nodes(node.kwargs, refs.__getitem__, fx.Node), node.type, meta))
                return (_rebuild_graph_module, (state, nodes))
            if isinstance(obj, (torch.SymFloat, torch.SymBool)):
                node = obj.node
                return (_rebuild_sym, (node._expr, node.shape_env, node.pytype, node._hint))
            if isinstance(obj, ShapeEnv):
                if self._shape_env is not None and obj is not self._shape_env:
                    raise GraphsNotSerializable("its symbolic values come from more than one ShapeEnv")
                self._shape_env = obj
            return super().reducer_override(obj)

    return StepGraphPickler


def dump_graphs(obj: Any) -> bytes:
    """``obj`` (nested containers and dataclasses holding GraphModules whose
    node metadata has fake tensors, SymInts and SymFloats) as bytes that
    :func:`load_graphs` turns back into equal graphs. Raises
    :class:`GraphsNotSerializable` saying what could not be written."""
    import io

    try:
        from torch.fx._graph_pickler import Options
    except ImportError as exc:  # pragma: no cover - a torch without it
        raise GraphsNotSerializable(f"this torch has no GraphPickler ({exc})") from exc
    stream = io.BytesIO()
    try:
        # every op may be written: aten's, _c10d_functional's, stepfx's own library ops
        _step_graph_pickler()(stream, Options(ops_filter=None)).dump(obj)
    except GraphsNotSerializable:
        raise
    except Exception as exc:  # pickle's and GraphPickler's own errors alike: say what it was
        raise GraphsNotSerializable(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}") from exc
    return stream.getvalue()


def load_graphs(data: bytes) -> Any:
    """What :func:`dump_graphs` wrote. Fake tensors and symbolic values come
    back in one new fake mode (``make_fake_mode``), whose ShapeEnv takes the
    saved one's state. ``_GraphUnpickler`` and ``_UnpickleState`` are the
    private halves of ``GraphPickler.loads``, which would add dynamo's
    timing scope and nothing else."""
    import io
    import warnings

    from torch.fx._graph_pickler import _GraphUnpickler, _UnpickleState

    with warnings.catch_warnings():
        # unpickling a pytree TreeSpec (a step's output structure) warns about LeafSpec on torch 2.13
        warnings.simplefilter("ignore", FutureWarning)
        return _GraphUnpickler(io.BytesIO(data), _UnpickleState(make_fake_mode())).load()


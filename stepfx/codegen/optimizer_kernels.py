"""Optimizer updates as one Triton launch each: Adam/AdamW and SGD over a flat buffer.

Each kernel reads a parameter, its gradient and its optimizer state once and
writes the new parameter and state once, with the gradient's scale factor
(fp16 loss-scale unscale x clip coefficient) and the overflow skip folded in:
the factor and the ``found_inf`` flag are 0-d device tensors loaded inside the
kernel, so nothing here syncs with the host.

Numerics: the op order is that of torch's single-tensor optimizers
(``_single_tensor_adam`` / ``_single_tensor_sgd``), and each fused
multiply-add is written as ``tl.fma`` exactly where torch's CUDA kernels fuse
one (``add(alpha=)``, ``lerp``, ``addcmul``, ``addcdiv``); automatic fusion is
off (``enable_fp_fusion=False``), so every other product is rounded as in
eager. Square root and division are IEEE (``sqrt_rn``, ``div_rn``), as in
torch's CUDA kernels. ``tensor / python_scalar`` in torch's CUDA kernels is a
multiply by the reciprocal (computed in double, rounded to fp32), and so it is
here. On CPU (the interpreter, for tests) torch divides and fuses differently,
so results there agree to a few fp32 ulps, not bitwise.

Each registered launcher has an eager ``*_reference`` with the same signature:
the spec, written with the torch ops torch's optimizer uses, in its order.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import multi_tensor
from .reduction_kernels import _rounded
from .registry import register

__all__ = ["adam_device_scalars", "adam_update", "adam_update_many", "adam_update_many_reference", "adam_update_reference", "sgd_update", "sgd_update_reference"]

# Elements per program: 2048 fp32 over 8 warps is 8 per thread, two 16-byte
# vector accesses per stream; 64M elements make 32K programs.
BLOCK = 2048
NUM_WARPS = 8
# The multi-tensor update: each program loops over MANY_ITERS blocks of one
# tensor (a chunk of BLOCK * MANY_ITERS elements) and reads its table entries
# once per chunk. On the 1.3B GPT's 292 tensors (H200, device time,
# benchmarks/optimizer_sweep.py): 1 block per program 10.03 ms (79% of the
# copy bandwidth), 2: 8.88, 4: 8.67 (92%), 8: 9.00; one flat tensor of the
# same size 8.34 ms. Neither one table row per program nor loading the next
# block before this block's stores helped (8.70 / 10.01 ms at 4 blocks).
MANY_ITERS = 4

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLAG_DTYPES = (torch.bool, torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- Adam


@triton.jit
def _adam_math(p0, g, m0, v0, grad_factor_ptr, scalars_ptr, decay, lerp_w, beta2, one_minus_beta2, inv_bc2_sqrt, eps,
               neg_step_size, COUPLED_WD: tl.constexpr, DECOUPLED_WD: tl.constexpr, MAXIMIZE: tl.constexpr,
               HAS_GRAD_FACTOR: tl.constexpr, DEVICE_SCALARS: tl.constexpr):
    """The new (p, m, v) of one block of elements: the update both Adam kernels run."""
    if HAS_GRAD_FACTOR:
        g = g * tl.load(grad_factor_ptr).to(tl.float32)
    if MAXIMIZE:
        g = -g
    p = p0
    if DECOUPLED_WD:
        p = p * decay  # param.mul_(1 - lr * wd)
    if COUPLED_WD:
        g = tl.fma(decay, p, g)  # grad.add(param, alpha=wd)
    # exp_avg.lerp_(g, w): torch's two-sided formula, chosen by |w| < 0.5.
    diff = g - m0
    m = tl.where(tl.abs(lerp_w) < 0.5, tl.fma(lerp_w, diff, m0), tl.fma(-diff, 1.0 - lerp_w, g))
    # exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    v = tl.fma(one_minus_beta2, g * g, v0 * beta2)
    # denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps); param.addcdiv_(m, denom, value=-step_size)
    if DEVICE_SCALARS:  # the step count lives on the device (fp16 skipped steps): scalars from there
        neg_step_size = tl.load(scalars_ptr)
        inv_bc2_sqrt = tl.load(scalars_ptr + 1)
    denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps
    p = tl.fma(neg_step_size, tl.div_rn(m, denom), p)
    return p, m, v


@triton.jit
def _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, grad_factor_ptr, scalars_ptr, decay, lerp_w, beta2,
                one_minus_beta2, inv_bc2_sqrt, eps, neg_step_size, COUPLED_WD: tl.constexpr, DECOUPLED_WD: tl.constexpr,
                MAXIMIZE: tl.constexpr, HAS_GRAD_FACTOR: tl.constexpr, DEVICE_SCALARS: tl.constexpr):
    """One block's loads and update: (p0, m0, v0) as loaded, (p, m, v) new."""
    p0 = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m0 = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v0 = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p, m, v = _adam_math(p0, g, m0, v0, grad_factor_ptr, scalars_ptr, decay, lerp_w, beta2, one_minus_beta2,
                         inv_bc2_sqrt, eps, neg_step_size, COUPLED_WD, DECOUPLED_WD, MAXIMIZE, HAS_GRAD_FACTOR,
                         DEVICE_SCALARS)
    return p0, m0, v0, p, m, v


@triton.jit
def _adam_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr,  # inputs: fp32, grad dtype, fp32, fp32
    p_out, m_out, v_out,  # outputs: the inputs themselves when INPLACE
    grad_factor_ptr, found_inf_ptr,  # 0-d device tensors (dummies when absent)
    scalars_ptr,  # [-step_size, 1/sqrt(bc2)] on the device (DEVICE_SCALARS; a dummy otherwise)
    n,
    decay,  # 1 - lr * weight_decay (decoupled) or weight_decay (coupled)
    lerp_w,  # 1 - beta1
    beta2, one_minus_beta2,
    inv_bc2_sqrt,  # 1 / sqrt(1 - beta2**step)
    eps,
    neg_step_size,  # -lr / (1 - beta1**step)
    COUPLED_WD: tl.constexpr, DECOUPLED_WD: tl.constexpr, MAXIMIZE: tl.constexpr,
    HAS_GRAD_FACTOR: tl.constexpr, HAS_FOUND_INF: tl.constexpr, INPLACE: tl.constexpr,
    DEVICE_SCALARS: tl.constexpr, BLOCK: tl.constexpr,
):
    # One Adam/AdamW step per element, fp32 math:
    #   g = grad * grad_factor;  g = -g if maximize
    #   p = p * (1 - lr*wd)             (decoupled)   |   g = g + wd * p   (coupled)
    #   m = lerp(m, g, 1 - beta1)
    #   v = v * beta2 + (1 - beta2) * g * g
    #   p = p - step_size * m / (sqrt(v) / sqrt(bc2) + eps)
    # Memory: reads p, m, v (12 B) + grad (2 or 4 B), writes p, m, v (12 B):
    # 26-28 B per element, the minimum. When found_inf != 0 nothing changes:
    # in place, every load and store is masked off (0 B); out of place, the
    # inputs are copied to the outputs.
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    n_live = n
    if HAS_FOUND_INF:
        skip = tl.load(found_inf_ptr) != 0
        if INPLACE:
            n_live = tl.where(skip, 0, n)
    mask = offs < n_live

    p0, m0, v0, p, m, v = _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, grad_factor_ptr, scalars_ptr, decay,
                                      lerp_w, beta2, one_minus_beta2, inv_bc2_sqrt, eps, neg_step_size, COUPLED_WD,
                                      DECOUPLED_WD, MAXIMIZE, HAS_GRAD_FACTOR, DEVICE_SCALARS)

    if HAS_FOUND_INF:
        if not INPLACE:
            p = tl.where(skip, p0, p)
            m = tl.where(skip, m0, m)
            v = tl.where(skip, v0, v)
    tl.store(p_out + offs, p, mask=mask)
    tl.store(m_out + offs, m, mask=mask)
    tl.store(v_out + offs, v, mask=mask)


def _check_tensor(name: str, t, dtypes, numel: int | None, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of: {allowed}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements (shape {tuple(t.shape)}); expected {numel}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); pass a contiguous tensor")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}; expected {device} like param")


def _check_scalars(param, grad_factor, found_inf) -> None:
    if grad_factor is not None:
        _check_tensor("grad_factor", grad_factor, (torch.float32,), 1, param.device)
    if found_inf is not None:
        _check_tensor("found_inf", found_inf, _FLAG_DTYPES, 1, param.device)


def _check_adam(param, grad, exp_avg, exp_avg_sq, step, grad_factor, found_inf) -> None:
    _check_tensor("param", param, (torch.float32,), None, None)
    n = param.numel()
    _check_tensor("grad", grad, _GRAD_DTYPES, n, param.device)
    _check_tensor("exp_avg", exp_avg, (torch.float32,), n, param.device)
    _check_tensor("exp_avg_sq", exp_avg_sq, (torch.float32,), n, param.device)
    _check_scalars(param, grad_factor, found_inf)
    if not step >= 1:
        raise ValueError(f"step must be >= 1 (the step count after this step's increment), got {step}")


def _device_guard(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def adam_update_reference(param, grad, exp_avg, exp_avg_sq, *, lr: float, beta1: float, beta2: float, eps: float,
                          weight_decay: float, step: float, decoupled: bool, maximize: bool = False,
                          grad_factor: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
                          inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager Adam/AdamW step, op for op as ``torch.optim.adam._single_tensor_adam``
    (``capturable=False, amsgrad=False``), plus the grad factor and overflow skip."""
    _check_adam(param, grad, exp_avg, exp_avg_sq, step, grad_factor, found_inf)
    p, m, v = param.clone(), exp_avg.clone(), exp_avg_sq.clone()
    g = grad.float()
    if grad_factor is not None:
        g = g * grad_factor
    if maximize:
        g = -g
    if weight_decay != 0:
        if decoupled:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p.view_as(g), alpha=weight_decay)
    g = g.view_as(m)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(m.view_as(p), denom.view_as(p), value=-step_size)
    if found_inf is not None:
        skip = found_inf.reshape(()) != 0
        p, m, v = torch.where(skip, param, p), torch.where(skip, exp_avg, m), torch.where(skip, exp_avg_sq, v)
    if inplace:
        param.copy_(p), exp_avg.copy_(m), exp_avg_sq.copy_(v)
        return param, exp_avg, exp_avg_sq
    return p, m, v


@register("adam_update", reference=adam_update_reference, jit=(_adam_math, _adam_block, _adam_kernel),
          what="Adam/AdamW step over a flat buffer: grad factor and overflow skip folded in, one launch")
def adam_update(param, grad, exp_avg, exp_avg_sq, *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: float | None, decoupled: bool, maximize: bool = False,
                grad_factor: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
                inplace: bool = False, device_scalars: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Adam (``decoupled=False``) or AdamW (``decoupled=True``) step, one Triton launch.

    ``step`` is the step count after this step's increment. ``grad`` (fp32,
    bf16 or fp16) is multiplied by ``grad_factor`` (0-d fp32 device tensor)
    when given. When ``found_inf`` (0-d bool or float device tensor) is
    nonzero nothing is written (out of place: the returned tensors equal the
    inputs); the flag is read inside the kernel, never on the host. Returns
    ``(param, exp_avg, exp_avg_sq)``: the inputs, updated, when ``inplace``,
    else new tensors (inputs untouched).

    ``device_scalars`` (from :func:`adam_device_scalars`, when the step count
    is a device tensor) replaces ``step``: the kernel loads the step size and
    bias correction from the device instead of receiving them from the host.
    """
    if device_scalars is not None:
        _check_tensor("device_scalars", device_scalars, (torch.float32,), 2, param.device)
        step = 1.0 if step is None else step  # unused: the kernel reads the scalars
    _check_adam(param, grad, exp_avg, exp_avg_sq, step, grad_factor, found_inf)
    if inplace:
        outs = (param, exp_avg, exp_avg_sq)
    else:
        outs = (torch.empty_like(param), torch.empty_like(exp_avg), torch.empty_like(exp_avg_sq))
    n = param.numel()
    if n == 0:
        return outs
    # Host scalars exactly as torch computes them (Python doubles); Triton
    # passes them as fp32, the precision torch's kernels cast them to. float()
    # first: an int would be passed as an integer (or specialized away when 1).
    lr, beta1, beta2, eps, weight_decay, step = map(float, (lr, beta1, beta2, eps, weight_decay, step))
    coupled = weight_decay != 0 and not decoupled
    decoupled_wd = weight_decay != 0 and decoupled
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    with _device_guard(param):
        _adam_kernel[(triton.cdiv(n, BLOCK),)](
            param, grad, exp_avg, exp_avg_sq, *outs,
            grad_factor if grad_factor is not None else param,
            found_inf if found_inf is not None else param,
            device_scalars if device_scalars is not None else param,
            n,
            weight_decay if coupled else 1 - lr * weight_decay,
            1 - beta1, beta2, 1 - beta2, 1.0 / bias_correction2_sqrt, eps, -step_size,
            COUPLED_WD=coupled, DECOUPLED_WD=decoupled_wd, MAXIMIZE=bool(maximize),
            HAS_GRAD_FACTOR=grad_factor is not None, HAS_FOUND_INF=found_inf is not None, INPLACE=bool(inplace),
            DEVICE_SCALARS=device_scalars is not None, BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False,
        )
    return outs


@triton.jit
def _adam_many_kernel(
    table_ptr,  # int64 [T, COLUMNS]: addresses of param, grad, exp_avg, exp_avg_sq (and copy) of tensor t
    blocks_ptr,  # int64 [B, 2]: (tensor, first element) of each program's block
    numels_ptr,  # int64 [T]
    grad_factor_ptr, found_inf_ptr, scalars_ptr,
    decay, lerp_w, beta2, one_minus_beta2, inv_bc2_sqrt, eps, neg_step_size,
    GRAD_DTYPE: tl.constexpr,
    COUPLED_WD: tl.constexpr, DECOUPLED_WD: tl.constexpr, MAXIMIZE: tl.constexpr,
    HAS_GRAD_FACTOR: tl.constexpr, HAS_FOUND_INF: tl.constexpr, DEVICE_SCALARS: tl.constexpr,
    HAS_COPY: tl.constexpr, COPY_DTYPE: tl.constexpr, COPY_BF16: tl.constexpr, COLUMNS: tl.constexpr,
    BLOCK: tl.constexpr, ITERS: tl.constexpr,
):
    # _adam_kernel's update, in place, over many tensors in one launch: each
    # program takes one chunk (ITERS blocks) of one tensor, whose addresses it
    # reads from the table (multi-tensor apply). Same math, same bits per element.
    # HAS_COPY: a fifth column holds the address of a 16-bit copy of the
    # parameter (0: none), written with the new values rounded to nearest
    # even, the bits of cast_pack / torch's .to(); 2 B more per element.
    # COLUMNS: 5 with HAS_COPY, else 4.
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(blocks_ptr + 2 * pid)
    start = tl.load(blocks_ptr + 2 * pid + 1)
    n = tl.load(numels_ptr + t)
    p_ptr = tl.load(table_ptr + COLUMNS * t).to(tl.pointer_type(tl.float32), bitcast=True)
    g_ptr = tl.load(table_ptr + COLUMNS * t + 1).to(tl.pointer_type(GRAD_DTYPE), bitcast=True)
    m_ptr = tl.load(table_ptr + COLUMNS * t + 2).to(tl.pointer_type(tl.float32), bitcast=True)
    v_ptr = tl.load(table_ptr + COLUMNS * t + 3).to(tl.pointer_type(tl.float32), bitcast=True)
    if HAS_COPY:
        copy_addr = tl.load(table_ptr + COLUMNS * t + 4)
        c_ptr = copy_addr.to(tl.pointer_type(COPY_DTYPE), bitcast=True)
    n_live = n
    if HAS_FOUND_INF:
        n_live = tl.where(tl.load(found_inf_ptr) != 0, 0, n)
    for i in tl.range(0, ITERS):
        # a block wholly past the tensor's end (a small tensor's chunk) is
        # skipped, not run masked: one scalar compare on the GPU, and under
        # Triton's interpreter (CPU tests) most of the kernel's work
        if start + i * BLOCK < n_live:
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n_live
            _, _, _, p, m, v = _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, grad_factor_ptr, scalars_ptr,
                                           decay, lerp_w, beta2, one_minus_beta2, inv_bc2_sqrt, eps, neg_step_size,
                                           COUPLED_WD, DECOUPLED_WD, MAXIMIZE, HAS_GRAD_FACTOR, DEVICE_SCALARS)
            tl.store(p_ptr + offs, p, mask=mask)
            tl.store(m_ptr + offs, m, mask=mask)
            tl.store(v_ptr + offs, v, mask=mask)
            if HAS_COPY:
                if copy_addr != 0:
                    tl.store(c_ptr + offs, _rounded(p, c_ptr, COPY_BF16), mask=mask)


def adam_update_many_reference(params, grads, exp_avgs, exp_avg_sqs, copies=None, **kwargs) -> None:
    """The spec: :func:`adam_update_reference` in place on each tensor in turn
    (host ``step`` only: the reference has no ``device_scalars``); then each
    given copy (``copies[i]``, or None) holds ``params[i].to(copy.dtype)``."""
    copies = [None] * len(params) if copies is None else copies
    for p, g, m, v, c in zip(params, grads, exp_avgs, exp_avg_sqs, copies, strict=True):
        adam_update_reference(p, g, m, v, inplace=True, **kwargs)
        if c is not None:
            c.copy_(p.view_as(c).to(c.dtype))


@register("adam_update_many", reference=adam_update_many_reference, jit=(_adam_math, _adam_block, _rounded, _adam_many_kernel),
          what="Adam/AdamW over many tensors in one launch per gradient dtype (addresses from a table)")
def adam_update_many(params, grads, exp_avgs, exp_avg_sqs, *, lr: float, beta1: float, beta2: float, eps: float,
                     weight_decay: float, step: float | None, decoupled: bool, maximize: bool = False,
                     grad_factor: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
                     device_scalars: torch.Tensor | None = None, copies=None) -> None:
    """:func:`adam_update` in place over lists of tensors, one launch per
    gradient dtype: the same bits as one call per tensor, without the
    launches (hundreds per step for a transformer's parameters).

    ``copies`` (one entry per parameter: a contiguous bf16/fp16 tensor of
    its size, or None; one dtype for all): the kernel also writes each
    updated parameter, rounded, into its copy (the next step's 16-bit
    compute copy, ``carry_parameter_copies``); a skipped step (``found_inf``)
    writes nothing there either."""
    count = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == count):
        raise ValueError(f"adam_update_many: {count} params, {len(grads)} grads, {len(exp_avgs)} exp_avg, "
                         f"{len(exp_avg_sqs)} exp_avg_sq")
    if count == 0:
        return
    device = params[0].device
    for i in range(count):
        for name, t in (("param", params[i]), ("grad", grads[i]), ("exp_avg", exp_avgs[i]), ("exp_avg_sq", exp_avg_sqs[i])):
            if not (isinstance(t, torch.Tensor) and t.is_contiguous() and t.device == device):
                raise ValueError(f"adam_update_many: {name} #{i} must be a contiguous tensor on {device}")
            if t.numel() != params[i].numel():
                raise ValueError(f"adam_update_many: {name} #{i} has {t.numel()} elements; param has {params[i].numel()}")
        if params[i].dtype != torch.float32 or exp_avgs[i].dtype != torch.float32 or exp_avg_sqs[i].dtype != torch.float32:
            raise ValueError(f"adam_update_many: tensor #{i}: param and state must be float32")
        if grads[i].dtype not in _GRAD_DTYPES:
            raise ValueError(f"adam_update_many: grad #{i} has dtype {grads[i].dtype}")
    copies = [None] * count if copies is None else list(copies)
    if len(copies) != count:
        raise ValueError(f"adam_update_many: {count} params, {len(copies)} copies")
    copy_dtypes = {c.dtype for c in copies if c is not None}
    if len(copy_dtypes) > 1 or not copy_dtypes <= {torch.bfloat16, torch.float16}:
        raise ValueError(f"adam_update_many: copies must all be bfloat16 or all float16, got {sorted(map(str, copy_dtypes))}")
    for i, c in enumerate(copies):
        if c is not None and not (c.is_contiguous() and c.device == device and c.numel() == params[i].numel()):
            raise ValueError(f"adam_update_many: copy #{i} must be a contiguous tensor on {device} of {params[i].numel()} elements")
    copy_dtype = next(iter(copy_dtypes), None)
    if device_scalars is not None:
        _check_tensor("device_scalars", device_scalars, (torch.float32,), 2, device)
        step = 1.0 if step is None else step
    _check_scalars(params[0], grad_factor, found_inf)
    lr, beta1, beta2, eps, weight_decay, step = map(float, (lr, beta1, beta2, eps, weight_decay, step))
    if not step >= 1:
        raise ValueError(f"step must be >= 1 (the step count after this step's increment), got {step}")
    coupled = weight_decay != 0 and not decoupled
    decoupled_wd = weight_decay != 0 and decoupled
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    step_size = lr / (1 - beta1**step)
    chunk = BLOCK * MANY_ITERS
    by_dtype: dict = {}
    for i in range(count):
        if params[i].numel():
            by_dtype.setdefault(grads[i].dtype, []).append(i)
    for dtype, members in by_dtype.items():
        columns = 4 if copy_dtype is None else 5
        ptrs = tuple(t.data_ptr() for i in members for t in (params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]))
        if copy_dtype is not None:  # the fifth column: the copy's address, 0 for none
            ptrs = tuple(a for k, i in enumerate(members) for a in (
                *ptrs[4 * k:4 * k + 4], 0 if copies[i] is None else copies[i].data_ptr()))
        numels = tuple(params[i].numel() for i in members)

        def geometry():
            rows = torch.stack(multi_tensor.blocks(numels, chunk), dim=1)
            return multi_tensor.device_table(rows, device), multi_tensor.device_table(list(numels), device)

        block_table, numel_table = multi_tensor.cached(("adam blocks", chunk, numels, device), geometry, geometry=True)
        table = multi_tensor.cached(("adam ptrs", columns, ptrs, device), lambda: multi_tensor.device_table(
            [list(ptrs[k:k + columns]) for k in range(0, len(ptrs), columns)], device))
        if multi_tensor.FALLBACK is None:
            try:
                with _device_guard(params[0]):
                    _adam_many_kernel[(block_table.shape[0],)](
                        table, block_table, numel_table,
                        grad_factor if grad_factor is not None else params[0],
                        found_inf if found_inf is not None else params[0],
                        device_scalars if device_scalars is not None else params[0],
                        weight_decay if coupled else 1 - lr * weight_decay,
                        1 - beta1, beta2, 1 - beta2, 1.0 / bias_correction2_sqrt, eps, -step_size,
                        GRAD_DTYPE=multi_tensor.TRITON_DTYPES[dtype], COUPLED_WD=coupled, DECOUPLED_WD=decoupled_wd,
                        MAXIMIZE=bool(maximize), HAS_GRAD_FACTOR=grad_factor is not None,
                        HAS_FOUND_INF=found_inf is not None, DEVICE_SCALARS=device_scalars is not None,
                        HAS_COPY=copy_dtype is not None,
                        COPY_DTYPE=multi_tensor.TRITON_DTYPES[copy_dtype or torch.bfloat16],
                        COPY_BF16=copy_dtype is torch.bfloat16, COLUMNS=columns,
                        BLOCK=BLOCK, ITERS=MANY_ITERS, num_warps=NUM_WARPS, enable_fp_fusion=False,
                    )
                continue
            except Exception as exc:  # a Triton that cannot build it: the per-tensor kernel does the same work
                multi_tensor.failed("Adam", exc)
        for i in members:
            adam_update(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                        weight_decay=weight_decay, step=step, decoupled=decoupled, maximize=maximize,
                        grad_factor=grad_factor, found_inf=found_inf, inplace=True, device_scalars=device_scalars)
            if copies[i] is not None:  # torch's rounding: the kernel's bits (a skipped step changed nothing)
                copies[i].copy_(params[i].view_as(copies[i]).to(copy_dtype))


def adam_device_scalars(step: torch.Tensor, *, lr: float, beta1: float, beta2: float) -> torch.Tensor:
    """``[-lr / (1 - beta1**step), 1 / sqrt(1 - beta2**step)]`` as an fp32
    tensor on ``step``'s device, for :func:`adam_update`'s ``device_scalars``.

    ``step`` (0-d, the count after this step's increment) stays on the
    device: under fp16 loss scaling a skipped step leaves it unchanged, which
    the host learns only later, so reading it would sync every step. The
    arithmetic is the host's, in fp64 (torch's optimizer computes these in
    Python doubles), rounded to fp32 once at the end: the values the host
    path passes. A few 0-d launches, once per step for all parameters.
    """
    lr, beta1, beta2 = float(lr), float(beta1), float(beta2)
    s = step.detach().reshape(()).to(torch.float64)
    step_size = lr / (1 - torch.pow(beta1, s))
    inv_bc2_sqrt = 1.0 / (1 - torch.pow(beta2, s)).sqrt()
    return torch.stack([-step_size, inv_bc2_sqrt]).to(torch.float32)


# --------------------------------------------------------------------------- SGD


@triton.jit
def _sgd_kernel(
    p_ptr, g_ptr, buf_ptr,  # inputs: fp32, grad dtype, fp32 (dummy without momentum)
    p_out, buf_out,  # outputs: the inputs themselves when INPLACE
    grad_factor_ptr, found_inf_ptr,
    n,
    neg_lr, weight_decay, momentum, one_minus_dampening,
    HAS_WD: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr,
    HAS_GRAD_FACTOR: tl.constexpr, HAS_FOUND_INF: tl.constexpr, INPLACE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One SGD step per element, fp32 math:
    #   g = grad * grad_factor;  g = -g if maximize;  g = g + wd * p
    #   buf = buf * momentum + (1 - dampening) * g
    #   g = g + momentum * buf (nesterov)  |  g = buf
    #   p = p - lr * g
    # Memory: reads p (4 B) + grad (2-4 B) [+ buf 4 B], writes p [+ buf]:
    # 8-16 B per element. found_inf != 0: as in _adam_kernel.
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    n_live = n
    if HAS_FOUND_INF:
        skip = tl.load(found_inf_ptr) != 0
        if INPLACE:
            n_live = tl.where(skip, 0, n)
    mask = offs < n_live

    p0 = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_GRAD_FACTOR:
        g = g * tl.load(grad_factor_ptr).to(tl.float32)
    if MAXIMIZE:
        g = -g
    if HAS_WD:
        g = tl.fma(weight_decay, p0, g)  # grad.add(param, alpha=wd)
    if HAS_MOMENTUM:
        buf0 = tl.load(buf_ptr + offs, mask=mask, other=0.0)
        buf = tl.fma(one_minus_dampening, g, buf0 * momentum)  # buf.mul_(momentum).add_(g, alpha=1 - dampening)
        if NESTEROV:
            g = tl.fma(momentum, buf, g)  # grad.add(buf, alpha=momentum)
        else:
            g = buf
    p = tl.fma(neg_lr, g, p0)  # param.add_(grad, alpha=-lr)

    if HAS_FOUND_INF:
        if not INPLACE:
            p = tl.where(skip, p0, p)
            if HAS_MOMENTUM:
                buf = tl.where(skip, buf0, buf)
    tl.store(p_out + offs, p, mask=mask)
    if HAS_MOMENTUM:
        tl.store(buf_out + offs, buf, mask=mask)


def _check_sgd(param, grad, momentum_buffer, momentum, grad_factor, found_inf) -> None:
    _check_tensor("param", param, (torch.float32,), None, None)
    n = param.numel()
    _check_tensor("grad", grad, _GRAD_DTYPES, n, param.device)
    if momentum != 0:
        if momentum_buffer is None:
            raise ValueError("momentum_buffer is None but momentum != 0; pass the (steady-state) momentum buffer")
        _check_tensor("momentum_buffer", momentum_buffer, (torch.float32,), n, param.device)
    elif momentum_buffer is not None:
        raise ValueError("momentum_buffer given but momentum == 0; torch's SGD keeps no buffer then: pass None")
    _check_scalars(param, grad_factor, found_inf)


def sgd_update_reference(param, grad, momentum_buffer, *, lr: float, momentum: float, dampening: float,
                         weight_decay: float, nesterov: bool, maximize: bool = False, grad_factor=None,
                         found_inf=None, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eager SGD step, op for op as ``torch.optim.sgd._single_tensor_sgd`` with an
    existing momentum buffer, plus the grad factor and overflow skip."""
    _check_sgd(param, grad, momentum_buffer, momentum, grad_factor, found_inf)
    p = param.clone()
    g = grad.float().view_as(p)
    if grad_factor is not None:
        g = g * grad_factor
    if maximize:
        g = -g
    if weight_decay != 0:
        g = g.add(p, alpha=weight_decay)
    buf = None
    if momentum != 0:
        buf = momentum_buffer.clone()
        buf.mul_(momentum).add_(g.view_as(buf), alpha=1 - dampening)
        if nesterov:
            g = g.add(buf.view_as(g), alpha=momentum)
        else:
            g = buf.view_as(g)
    p.add_(g, alpha=-lr)
    if found_inf is not None:
        skip = found_inf.reshape(()) != 0
        p = torch.where(skip, param, p)
        if buf is not None:
            buf = torch.where(skip, momentum_buffer, buf)
    if inplace:
        param.copy_(p)
        if buf is not None:
            momentum_buffer.copy_(buf)
        return param, momentum_buffer
    return p, buf


@register("sgd_update", reference=sgd_update_reference, jit=(_sgd_kernel,),
          what="SGD (momentum, Nesterov) step over a flat buffer: grad factor and overflow skip folded in, one launch")
def sgd_update(param, grad, momentum_buffer, *, lr: float, momentum: float, dampening: float, weight_decay: float,
               nesterov: bool, maximize: bool = False, grad_factor=None, found_inf=None,
               inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One SGD step (steady state: ``momentum_buffer`` exists iff ``momentum != 0``), one Triton launch.

    ``grad_factor``, ``found_inf`` and ``inplace`` as in :func:`adam_update`.
    Returns ``(param, momentum_buffer)``; the buffer is None when momentum is 0.
    """
    _check_sgd(param, grad, momentum_buffer, momentum, grad_factor, found_inf)
    lr, momentum, dampening, weight_decay = map(float, (lr, momentum, dampening, weight_decay))
    has_momentum = momentum != 0
    if inplace:
        p_out, buf_out = param, momentum_buffer
    else:
        p_out = torch.empty_like(param)
        buf_out = torch.empty_like(momentum_buffer) if has_momentum else None
    n = param.numel()
    if n == 0:
        return p_out, buf_out
    with _device_guard(param):
        _sgd_kernel[(triton.cdiv(n, BLOCK),)](
            param, grad, momentum_buffer if has_momentum else param,
            p_out, buf_out if has_momentum else p_out,
            grad_factor if grad_factor is not None else param,
            found_inf if found_inf is not None else param,
            n,
            -lr, weight_decay, momentum, 1 - dampening,
            HAS_WD=weight_decay != 0, HAS_MOMENTUM=has_momentum, NESTEROV=bool(nesterov), MAXIMIZE=bool(maximize),
            HAS_GRAD_FACTOR=grad_factor is not None, HAS_FOUND_INF=found_inf is not None, INPLACE=bool(inplace),
            BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False,
        )
    return p_out, buf_out

"""The functions a step graph calls where a fusion pass put a kernel.

Each takes graph values (tensors, and the host scalars the graph already
has: the learning rate and step counters live on the CPU, so reading them
costs no device sync) and launches the Triton kernel; ``*_reference`` runs
the same contract with eager PyTorch (the kernel's registered reference),
which the passes use to check that the ops they replace compute it.

The kernel modules are imported when first used: Triton decides between
compiling and interpreting when a kernel is defined.
"""
from __future__ import annotations

import importlib

import torch

from .. import compat

__all__ = ["adam_step", "adam_step_reference", "sgd_step", "sgd_step_reference", "host_float", "sum_squares",
           "layer_norm", "layer_norm_backward", "cat_column_sum", "addmm_gelu",
           "linear_cross_entropy", "vocab_cross_entropy_stats", "vocab_cross_entropy_grads", "attention",
           "attention_backward", "attention_cpu", "attention_cpu_backward", "KERNELS_OF", "kernels_of"]


def host_float(value) -> float:
    """A Python float from a host scalar: a number, or a CPU tensor (never a device tensor: that would sync)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"expected a host scalar, got a tensor on {value.device}")
        return float(value)
    return float(value)


def _kernels(name: str):
    return importlib.import_module(f"stepfx.codegen.{name}")


def _adam_args(lr, beta1, beta2, step, step_is_new):
    return dict(lr=host_float(lr), beta1=host_float(beta1), beta2=host_float(beta2),
                step=host_float(step) + (0.0 if step_is_new else 1.0))


def adam_step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, step, grad_factor=None, found_inf=None, *,
              step_is_new: bool, eps: float, weight_decay: float, decoupled: bool, maximize: bool, inplace: bool,
              step_on_device: bool = False):
    """One Adam/AdamW update of a parameter (or ZeRO piece): the fused kernel.
    ``step`` is the step counter before this step's increment unless
    ``step_is_new``; with ``step_on_device`` it is :func:`adam_scalars`'s
    result instead (lr, betas and step then unused). Returns (param,
    exp_avg, exp_avg_sq)."""
    if step_on_device:
        return _kernels("optimizer_kernels").adam_update(
            param, grad, exp_avg, exp_avg_sq, eps=eps, weight_decay=weight_decay, decoupled=decoupled,
            maximize=maximize, grad_factor=grad_factor, found_inf=found_inf, inplace=inplace,
            lr=host_float(lr), beta1=host_float(beta1), beta2=host_float(beta2), step=None, device_scalars=step)
    return _kernels("optimizer_kernels").adam_update(
        param, grad, exp_avg, exp_avg_sq, eps=eps, weight_decay=weight_decay, decoupled=decoupled, maximize=maximize,
        grad_factor=grad_factor, found_inf=found_inf, inplace=inplace, **_adam_args(lr, beta1, beta2, step, step_is_new))


def adam_step_many(count: int, *flat, step_is_new: bool, eps: float, weight_decay: float, decoupled: bool,
                   maximize: bool, step_on_device: bool = False, copy_offsets: tuple[int, ...] | None = None):
    """``count`` in-place Adam/AdamW updates in one launch per gradient dtype.
    ``flat``: the params, then the grads, the exp_avgs, the exp_avg_sqs
    (``count`` each), then lr, beta1, beta2, step, grad_factor, found_inf as
    :func:`adam_step` takes them. Returns (param, exp_avg, exp_avg_sq) of
    each tensor in turn, flat: the inputs, updated.

    With ``copy_offsets`` (one per parameter, -1 for none) ``flat`` ends with
    a flat 16-bit buffer: parameter i's updated value, rounded, is written
    into it at its offset, and the buffer (updated in place) is the last
    result (``carry_parameter_copies``: the next step's compute copies)."""
    ps, gs, ms, vs = (list(flat[i * count:(i + 1) * count]) for i in range(4))
    lr, beta1, beta2, step, grad_factor, found_inf = flat[4 * count:4 * count + 6]
    copies, buffer = None, None
    if copy_offsets is not None:
        buffer = flat[4 * count + 6]
        copies = [buffer[o:o + p.numel()] if o >= 0 else None for o, p in zip(copy_offsets, ps, strict=True)]
    kernels = _kernels("optimizer_kernels")
    common = dict(eps=eps, weight_decay=weight_decay, decoupled=decoupled, maximize=maximize,
                  grad_factor=grad_factor, found_inf=found_inf, copies=copies)
    if step_on_device:
        kernels.adam_update_many(ps, gs, ms, vs, lr=host_float(lr), beta1=host_float(beta1), beta2=host_float(beta2),
                                 step=None, device_scalars=step, **common)
    else:
        kernels.adam_update_many(ps, gs, ms, vs, **common, **_adam_args(lr, beta1, beta2, step, step_is_new))
    results = tuple(t for i in range(count) for t in (ps[i], ms[i], vs[i]))
    return results if buffer is None else results + (buffer,)


def adam_scalars(step, lr, beta1, beta2, *, step_is_new: bool):
    """Adam's step size and bias correction from a step counter that lives on
    the device (fp16 loss scaling keeps it there: a skipped step leaves it
    unchanged), computed there once per step for every parameter's kernel."""
    if not step_is_new:
        step = step + 1
    return _kernels("optimizer_kernels").adam_device_scalars(
        step, lr=host_float(lr), beta1=host_float(beta1), beta2=host_float(beta2))


def adam_step_reference(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, step, grad_factor=None, found_inf=None, *,
                        step_is_new: bool, eps: float, weight_decay: float, decoupled: bool, maximize: bool, inplace: bool):
    from .registry import KERNELS

    _kernels("optimizer_kernels")
    return KERNELS["adam_update"].reference(
        param, grad, exp_avg, exp_avg_sq, eps=eps, weight_decay=weight_decay, decoupled=decoupled, maximize=maximize,
        grad_factor=grad_factor, found_inf=found_inf, inplace=False, **_adam_args(lr, beta1, beta2, step, step_is_new))


def sgd_step(param, grad, momentum_buffer, lr, grad_factor=None, found_inf=None, *, momentum: float, dampening: float,
             weight_decay: float, nesterov: bool, maximize: bool, inplace: bool):
    """One SGD update: the fused kernel. Returns (param, momentum_buffer)."""
    return _kernels("optimizer_kernels").sgd_update(
        param, grad, momentum_buffer, lr=host_float(lr), momentum=momentum, dampening=dampening,
        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, grad_factor=grad_factor,
        found_inf=found_inf, inplace=inplace)


def sgd_step_reference(param, grad, momentum_buffer, lr, grad_factor=None, found_inf=None, *, momentum: float,
                       dampening: float, weight_decay: float, nesterov: bool, maximize: bool, inplace: bool):
    from .registry import KERNELS

    _kernels("optimizer_kernels")
    return KERNELS["sgd_update"].reference(
        param, grad, momentum_buffer, lr=host_float(lr), momentum=momentum, dampening=dampening,
        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, grad_factor=grad_factor,
        found_inf=found_inf, inplace=False)


def sum_squares(x):
    """The sum of ``x.float() ** 2`` (a 0-d fp32 tensor), one read of ``x``: the fused kernel."""
    return _kernels("reduction_kernels").sum_squares(x)


def sum_squares_many(*xs):
    """``stack([sum_squares(x) for x in xs])`` in two launches per dtype: the fused kernel."""
    return _kernels("reduction_kernels").sum_squares_many(*xs)


def layer_norm(input, normalized_shape, weight, bias, eps):
    """``aten.native_layer_norm``'s contract: (out, mean, rstd), by stepfx's kernel."""
    return _kernels("norm_kernels").layer_norm_forward(input, normalized_shape, weight, bias, eps)


def add_layer_norm(input, residual, normalized_shape, weight, bias, eps):
    """``(input + residual, *aten.native_layer_norm(that sum, ...))`` in one
    kernel: a residual add and the LayerNorm that reads it
    (``fuse_residual_layer_norm``)."""
    return _kernels("norm_kernels").add_layer_norm_forward(input, residual, normalized_shape, weight, bias, eps)


def rms_norm(input, normalized_shape, weight, eps):
    """``aten._fused_rms_norm``'s contract: (out, rstd), by stepfx's kernel (``fuse_rms_norm``)."""
    return _kernels("norm_kernels").rms_norm_forward(input, normalized_shape, weight, eps)


def rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask, grad_weight_dtype=None):
    """``aten._fused_rms_norm_backward``'s contract: (grad_input, grad_weight), by stepfx's kernel; the
    weight's gradient in ``grad_weight_dtype`` where given (an fp32 weight of a 16-bit input)."""
    return _kernels("norm_kernels").rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask,
                                                      grad_weight_dtype)


def layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask, *, residual_grad=None,
                        grad_input_sum=None):
    """``aten.native_layer_norm_backward``'s contract: (grad_input, grad_weight, grad_bias);
    with ``residual_grad``, grad_input + residual_grad in its place (``fuse_residual_layer_norm``);
    with ``grad_input_sum`` ("keepdim" / "flat"), a fourth result: grad_input's column sum
    (``fuse_bias_gradients``)."""
    return _kernels("norm_kernels").layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias,
                                                        output_mask, residual_grad, grad_input_sum)


def linear_cross_entropy(hidden, weight, target, *, ignore_index: int, reduction: str, logits_dtype):
    """(loss, d loss/d hidden, d loss/d weight) of ``cross_entropy(hidden @ weight.T)`` for a unit upstream
    gradient, in row chunks: the fused kernel."""
    return _kernels("cross_entropy_kernels").linear_cross_entropy(
        hidden, weight, target, ignore_index=ignore_index, reduction=reduction, logits_dtype=logits_dtype)


def vocab_cross_entropy_stats(hidden, weight, target, *, offset: int, ignore_index: int, logits_dtype):
    """Over a vocabulary shard (tensor parallelism): per row of ``hidden @ weight.T``, (max, sum of
    exponentials, the target's logit where the rank holds it, the kept logits): the first half of the fused
    head + loss, before the group's all-reduces (``fuse_linear_cross_entropy``)."""
    return _kernels("cross_entropy_kernels").vocab_cross_entropy_stats(
        hidden, weight, target, offset=offset, ignore_index=ignore_index, logits_dtype=logits_dtype)


def vocab_cross_entropy_grads(hidden, weight, target, lse, scale, logits, *, offset: int, ignore_index: int,
                              logits_dtype):
    """Over a vocabulary shard: the unit-upstream gradients (this rank's summand of grad_hidden, its rows of
    grad_weight) from the group's log-sum-exp per row; ``scale`` None for a sum, 1 / count for a mean."""
    if scale is None:
        scale = torch.ones((), dtype=torch.float32, device=hidden.device)
    return _kernels("cross_entropy_kernels").vocab_cross_entropy_grads(
        hidden, weight, target, lse, scale, logits, offset=offset, ignore_index=ignore_index,
        logits_dtype=logits_dtype)


def cast(x, *, dtype):
    """``x.to(dtype)`` (fp32 -> bf16/fp16, round to nearest even) by stepfx's
    vectorized kernel: torch's dtype-converting copy runs an unrolled,
    unvectorized loop (~1.6 TB/s on an H200 against ~3.5)."""
    return _kernels("reduction_kernels").cast_pack([(x, 0)], x.numel(), dtype).view(x.shape)


def pack(parts, offsets, total: int, *, dtype, scale: float | None = None, out=None):
    """A new flat ``total``-element bucket of ``dtype`` (or ``out``, written
    over): each part flattened,
    converted (multiplied by ``scale`` first, if given) and written at its
    offset, zeros elsewhere, in one pass (``fuse_bucket_packing``: the
    collectives' buckets)."""
    return _kernels("reduction_kernels").cast_pack(list(zip(parts, offsets, strict=True)), total, dtype, scale, out)


def column_sum(x, *, keepdim: bool):
    """``aten.sum(x, [0], keepdim)`` of a 2-D tensor (a linear layer's bias
    gradient) by stepfx's column-sum kernel: torch's reduction ran at about
    half the copy bandwidth there, after a memset."""
    return _kernels("reduction_kernels").column_sum(x, keepdim)


def addmm_gelu(bias, x, weight_t):
    """``aten.gelu(aten.addmm(bias, x, weight_t), approximate='tanh')`` where nothing else reads the
    pre-activation (``fuse_linear_gelu``): on CUDA the GELU is the matmul's epilogue (cuBLASLt, through torch),
    so the pre-activation is never written and read back; elsewhere the two ops, as they were."""
    if x.is_cuda:
        return compat.addmm_gelu_epilogue(bias, x, weight_t)
    return torch.nn.functional.gelu(torch.addmm(bias, x, weight_t), approximate="tanh")


addmm_gelu.stepfx_matmul_args = 1  # node_flops: a matmul of args[1] and args[2]


def run_region(key: str, *inputs):
    """A generic region of the step (pointwise ops and row reductions), compiled by inductor: see
    :mod:`stepfx.codegen.regions`. Returns the region's outputs as a tuple."""
    from .regions import REGIONS

    return REGIONS[key](*inputs)


def cat_column_sum(parts, *, keepdim: bool):
    """(``aten.cat(parts, -1)``, its sum over every dim but the last) in one pass: attention's
    q, k, v gradients into the qkv projection's, and its bias gradient (``fuse_bias_gradients``)."""
    return _kernels("column_sum_kernels").cat_column_sum(parts, keepdim)


def attention(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None,
              out_order=None):
    """``aten._scaled_dot_product_flash_attention``'s contract (no dropout, no debug mask) by stepfx's Triton
    attention (``fuse_attention``): one compile for every length. The logsumexp slot holds base-2 log-sum-exps,
    read only by :func:`attention_backward`; ``out_order`` is the memory order the graph recorded for the output."""
    kernels = _kernels("attention_kernels")
    out, lse = kernels.attention_forward(query, key, value, bool(is_causal), scale, out_order=out_order,
                                         check=False)  # fuse_attention checked the call at capture
    seed, offset, debug = _unused_attention_outputs(query.device, query.dtype)
    return out, lse, None, None, query.shape[2], key.shape[2], seed, offset, debug


_UNUSED: dict = {}


def _unused_attention_outputs(device, dtype):
    """Flash's random state and debug mask, which no dropout leaves unread: one set per device and dtype,
    made once (nothing writes them), instead of three allocations a call."""
    key = (device, dtype)
    if key not in _UNUSED:
        _UNUSED[key] = (torch.empty(2, dtype=torch.uint64, device=device),
                        torch.empty((), dtype=torch.uint64, device=device), torch.empty(0, dtype=dtype, device=device))
    return _UNUSED[key]


def attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q=None, cum_seq_k=None, max_q=0,
                       max_k=0, dropout_p=0.0, is_causal=False, philox_seed=None, philox_offset=None, *, scale=None,
                       grad_orders=None):
    """``aten._scaled_dot_product_flash_attention_backward``'s contract for :func:`attention`'s forward: the
    query, key and value gradients, each in the memory order ``grad_orders`` gives (as the graph recorded)."""
    return _kernels("attention_kernels").attention_backward(grad_out, query, key, value, out, logsumexp,
                                                             bool(is_causal), scale, grad_orders=grad_orders)


def attention_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None, out_order=None):
    """``aten._scaled_dot_product_flash_attention_for_cpu``'s contract (no mask, no dropout) by the same kernels
    (CPU: Triton's interpreter, for tests): (out, base-2 logsumexp)."""
    return _kernels("attention_kernels").attention_forward(query, key, value, bool(is_causal), scale,
                                                           out_order=out_order, check=False)


def attention_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *,
                           attn_mask=None, scale=None, grad_orders=None):
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward``'s contract for :func:`attention_cpu`."""
    return _kernels("attention_kernels").attention_backward(grad_out, query, key, value, out, logsumexp,
                                                             bool(is_causal), scale, grad_orders=grad_orders)


# graph function -> (its kernel module, the registered kernels it launches), for explain() and the dumps
KERNELS_OF = {
    adam_step: ("optimizer_kernels", ("adam_update",)),
    adam_step_many: ("optimizer_kernels", ("adam_update_many",)),
    sgd_step: ("optimizer_kernels", ("sgd_update",)),
    sum_squares: ("reduction_kernels", ("sum_squares",)),
    sum_squares_many: ("reduction_kernels", ("sum_squares_many",)),
    cast: ("reduction_kernels", ("cast_pack",)),
    pack: ("reduction_kernels", ("cast_pack",)),
    column_sum: ("reduction_kernels", ("column_sum",)),
    layer_norm: ("norm_kernels", ("layer_norm_forward",)),
    add_layer_norm: ("norm_kernels", ("add_layer_norm_forward",)),
    layer_norm_backward: ("norm_kernels", ("layer_norm_backward",)),
    cat_column_sum: ("column_sum_kernels", ("cat_column_sum",)),
    attention: ("attention_kernels", ("attention_forward",)),
    attention_backward: ("attention_kernels", ("attention_backward",)),
    attention_cpu: ("attention_kernels", ("attention_forward",)),
    attention_cpu_backward: ("attention_kernels", ("attention_backward",)),
    linear_cross_entropy: ("cross_entropy_kernels", ("linear_cross_entropy",)),
    vocab_cross_entropy_stats: ("cross_entropy_kernels", ("vocab_cross_entropy_stats",)),
    vocab_cross_entropy_grads: ("cross_entropy_kernels", ("vocab_cross_entropy_grads",)),
}


def kernels_of(fn) -> tuple[str, ...]:
    """The registered kernels a graph function launches (importing its module registers them)."""
    module, names = KERNELS_OF[fn]
    _kernels(module)
    return names

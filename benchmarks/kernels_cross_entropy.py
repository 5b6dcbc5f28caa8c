"""Benchmark cases for ``linear_cross_entropy`` (chunked linear + cross-entropy,
loss and both gradients) against eager PyTorch and torch.compile.

The workload is a GPT head: ``F.cross_entropy((hidden @ weight.T).float(), target)``
and its backward, bf16 inputs, vocab 50304, 8192 rows (micro-batch 4 x seq 2048).
Eager materializes the bf16 logits, their fp32 copy, the log-softmax and the
gradient (GBs); stepfx holds one chunk of bf16 logits at a time.

:func:`cases` only builds the cases; a driver times them, measures peak
memory, and reports ratios (see ../shared/BENCHMARKS.md). Importing this
module needs no GPU; calling the cases does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 50304
ROWS = 8192  # micro-batch 4 x seq 2048
WIDTHS = (2048, 1024)  # the 1.3B and 350M GPTs


def _loss(hidden, weight, target):
    return F.cross_entropy((hidden @ weight.t()).float(), target)


def _with_grads(loss_fn, hidden, weight, target):
    """Forward and backward through autograd: the loss and d loss / d (hidden, weight)."""
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    loss = loss_fn(h, w, target)
    grad_hidden, grad_weight = torch.autograd.grad(loss, (h, w))
    return loss.detach(), grad_hidden, grad_weight


def _case(d: int, device: str) -> dict:
    from stepfx.codegen.cross_entropy_kernels import linear_cross_entropy

    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(ROWS, d, device=device, generator=g).to(torch.bfloat16)
    weight = (torch.randn(VOCAB, d, device=device, generator=g) * d**-0.5).to(torch.bfloat16)
    target = torch.randint(0, VOCAB, (ROWS,), device=device, generator=g)
    compiled: list = []

    def run_compiled():
        if not compiled:  # built on first use: importing or listing cases compiles nothing
            compiled.append(torch.compile(_loss))
        return _with_grads(compiled[0], hidden, weight, target)

    elt = hidden.element_size()
    return {
        "name": f"linear_cross_entropy_{ROWS}x{d}x{VOCAB}_bf16_logits_fp32",
        "stepfx": lambda: linear_cross_entropy(hidden, weight, target, logits_dtype=torch.float32),
        "eager": lambda: _with_grads(_loss, hidden, weight, target),
        "compiled": run_compiled,
        # read hidden, weight and target once, write both gradients once
        "bytes": 2 * (ROWS * d + VOCAB * d) * elt + ROWS * target.element_size(),
        # three matmuls: logits, grad_hidden, grad_weight
        "flops": 3 * 2 * ROWS * VOCAB * d,
    }


def cases(device: str = "cuda") -> list[dict]:
    """One case per model width (d 2048: the 1.3B GPT; d 1024: the 350M)."""
    return [_case(d, device) for d in WIDTHS]

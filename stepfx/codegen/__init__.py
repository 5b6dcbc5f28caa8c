"""codegen: the kernels stepfx emits into a step, and where each region goes.

Which regions go where, and why:

- **Written here, in Triton** — what is specific to a training step and what
  no general fuser sees whole: the optimizer update over a parameter or a
  flat ZeRO piece with the fp16 unscale, the clip factor and the overflow
  skip folded in (``optimizer_kernels``); the sum of squares behind the
  clipping norm and the overflow check, one read per gradient
  (``reduction_kernels``); packing and casting pieces for collectives
  (``reduction_kernels.cast_pack``); LayerNorm / RMSNorm forward and
  backward (``norm_kernels``); linear + cross-entropy in row chunks that
  never materialize the full fp32 logits (``cross_entropy_kernels``);
  bias gradients summed by the kernel that writes their input
  (``column_sum_kernels``, and the LayerNorm backward's ``grad_input_sum``).
- **Handed to inductor** — the generic rest: chains of pointwise ops and
  the row reductions between them (an RMSNorm written out by hand, rotary
  embeddings, activation backward chains). Inductor fuses those well and a
  second hand-written inductor is not the goal: ``fuse_generic_regions``
  cuts them out as small fx graphs and :mod:`.regions` compiles each once
  (identical layers share it); a region inductor cannot compile runs as
  its ops. On CUDA only by default (inductor's CPU backend compiles C++).
- **Left to torch** — matmuls and attention (cuBLAS and flash attention are
  already at the hardware's limit), and single pointwise ops (one aten
  kernel already).

Every kernel is registered in :data:`KERNELS` with its eager reference and
its Triton source, which ``explain()`` and the dumps show. Triton caches
compiled kernels itself (per signature and constants, on disk).

On CPU the kernels run only under ``TRITON_INTERPRET=1`` (Triton's
interpreter: for tests), which must be set before this package's kernel
modules are imported; codegen is therefore off by default on CPU.
"""
from __future__ import annotations

from .registry import KERNELS, Kernel, available, kernel_source, register

__all__ = ["KERNELS", "Kernel", "available", "kernel_source", "register"]

"""Fusion passes: ops that stepfx's own kernels compute, swapped in by op
identity when codegen is on.

Linear + cross-entropy, layer norm (with its residual add), sums of
squares, column sums and bias gradients, casts, the optimizer update, and
the multi-tensor batching of updates and sums; last, generic regions of
what is left go to inductor. The values are those of the ops replaced.
"""

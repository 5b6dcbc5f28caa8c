"""Mixed-precision passes: fp16/bf16 compute over fp32 master state.

Unscaling and clipping gradients, skipping a step whose gradients
overflowed, and the 16-bit compute copies of the parameters and the fp32
copies of the gradients: made in one launch, carried between steps, or
not made at all where fused kernels read 16 bits themselves.
"""

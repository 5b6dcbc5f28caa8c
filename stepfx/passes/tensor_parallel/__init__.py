"""Tensor-parallel passes (none yet): Megatron-style splitting of linear
layers and attention heads across the ranks of a tensor-parallel group.
"""

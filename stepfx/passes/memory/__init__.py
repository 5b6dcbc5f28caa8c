"""Memory passes: activation checkpointing (recompute_activations); offload
and the planner that chooses between them against a memory budget come next.
"""

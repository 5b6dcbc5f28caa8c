"""Memory passes (none yet): activation checkpointing, offload, and the
planner that chooses between them against a memory budget.
"""

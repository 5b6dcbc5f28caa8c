"""Data-parallel passes: ZeRO stages 0-3 over the ranks of one group.

Planning the bucket layout, averaging gradients, sharding the optimizer
update and the parameters, holding accumulated gradients on the rank,
placing gradients and scheduling collectives so communication overlaps
the backward, and packing each bucket in one kernel. ``collectives`` is
not a pass: it holds the helpers these passes (and others) use to build
nodes. Mesh facts arrive as data in ``PassOptions``; no pass touches a
process group.
"""

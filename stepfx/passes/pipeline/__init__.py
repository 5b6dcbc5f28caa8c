"""Pipeline-parallel passes (none yet): splitting the step into stages, one
per rank of a pipeline group, and scheduling their micro-batches.

The declared pass pipeline (the ordered list of passes) is not here: it
is ``stepfx.passes.declared``.
"""

"""Public testing helpers (TEMPORARY: the rank pool lands from branch `testing`)."""
from .equivalence import EquivalenceReport, assert_step_equivalent, compare_tensors

__all__ = ["assert_step_equivalent", "EquivalenceReport", "compare_tensors"]

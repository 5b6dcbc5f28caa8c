"""assert_step_equivalent must be able to fail: it catches real divergences."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stepfx.testing.equivalence import assert_step_equivalent, compare_tensors
from tests.steps import MLP, ce_step, mlp_batches


def test_compare_tensors_reports_the_worst_element():
    a = torch.tensor([1.0, 2.0, 3.0])
    b = torch.tensor([1.0, 2.0 + 1e-3, 3.0])
    with pytest.raises(AssertionError, match=r"1 of 3 elements differ.*element 1"):
        compare_tensors("w", a, b, rtol=1e-6, atol=0.0)
    assert compare_tensors("w", a, a.clone(), rtol=0.0, atol=0.0) == (0.0, 0.0)
    with pytest.raises(AssertionError, match="shape/dtype"):
        compare_tensors("w", a, a.double(), rtol=1e-6, atol=0.0)


def test_python_side_effects_that_stepfx_does_not_replay_are_caught():
    calls = []

    def step(model, optimizer, x, y):
        calls.append(1)  # Python state: runs once under stepfx (at capture), every call eagerly
        scale = float(len(calls))
        loss = F.cross_entropy(model(x), y) * scale
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    with pytest.raises(AssertionError, match=r"step \d: output leaf 0"):
        assert_step_equivalent(step, lambda: MLP((8, 16, 4)), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), mlp_batches(4))


def test_a_different_update_is_caught_in_state():
    def step(model, optimizer, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach() * 0  # outputs agree ...

    # ... but the eager side trains a different copy (lr differs per side through a global)
    lrs = iter([0.1, 0.2] * 10)

    def make_opt(m):
        return torch.optim.SGD(m.parameters(), lr=next(lrs))

    with pytest.raises(AssertionError, match=r"after step 0: net\.0\.weight"):
        assert_step_equivalent(step, lambda: MLP((8, 16, 4)), make_opt, mlp_batches(2))


def test_report_of_an_exact_run():
    report = assert_step_equivalent(ce_step, lambda: MLP((8, 16, 4)), lambda m: torch.optim.Adam(m.parameters()), mlp_batches(2), exact=True)
    assert report.bitwise and str(report) == "2 steps, bitwise equal"

"""multi_tensor: the block tables the multi-tensor kernels read, and the
caches that keep them (geometry never pushed out by address churn)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stepfx.codegen import multi_tensor


@settings(max_examples=40, deadline=None)
@given(numels=st.lists(st.integers(1, 5000), min_size=1, max_size=12), block=st.sampled_from([1, 7, 64, 2048]))
def test_blocks_lists_each_block_as_the_loop_does(numels, block):
    index, first = multi_tensor.blocks(numels, block)
    expected = [(j, s) for j, n in enumerate(numels) for s in range(0, n, block)]
    assert list(zip(index.tolist(), first.tolist(), strict=True)) == expected


def test_address_churn_does_not_evict_geometry(monkeypatch):
    monkeypatch.setattr(multi_tensor, "_CACHES", {True: multi_tensor.OrderedDict(), False: multi_tensor.OrderedDict()})
    builds = []

    def geometry():
        builds.append("geometry")
        return "g"

    assert multi_tensor.cached(("blocks", (10, 20)), geometry, geometry=True) == "g"
    for step in range(3 * multi_tensor._CACHE_SIZE[False]):  # a new gradient address every step
        assert multi_tensor.cached(("ptrs", step), lambda step=step: step) == step
        assert multi_tensor.cached(("blocks", (10, 20)), geometry, geometry=True) == "g"
    assert builds == ["geometry"]
    assert len(multi_tensor._CACHES[False]) == multi_tensor._CACHE_SIZE[False]


def test_cache_drops_the_least_recently_used(monkeypatch):
    monkeypatch.setattr(multi_tensor, "_CACHES", {True: multi_tensor.OrderedDict(), False: multi_tensor.OrderedDict()})
    monkeypatch.setattr(multi_tensor, "_CACHE_SIZE", {True: 2, False: 2})
    calls = []

    def build(name):
        calls.append(name)
        return name

    multi_tensor.cached("a", lambda: build("a"))
    multi_tensor.cached("b", lambda: build("b"))
    multi_tensor.cached("a", lambda: build("a"))  # a used again: b is now the oldest
    multi_tensor.cached("c", lambda: build("c"))  # drops b
    multi_tensor.cached("a", lambda: build("a"))
    multi_tensor.cached("b", lambda: build("b"))
    assert calls == ["a", "b", "c", "b"]


def test_device_table_takes_lists_and_tensors():
    rows = [[1, 2], [3, 4]]
    assert multi_tensor.device_table(rows, torch.device("cpu")).tolist() == rows
    assert multi_tensor.device_table(torch.tensor(rows, dtype=torch.int32), torch.device("cpu")).tolist() == rows

"""capture/batch_reads.py: which entries of the batch dicts a step fetches.
A value is left out of the fingerprint only if no way of reading it was
taken, so every way Python code reads a dict must count as a fetch."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.utils._pytree as pytree

from stepfx.capture.batch_reads import NOT_READ, BatchReads, WatchedDict, without_unread


def _batch():
    return {"input_ids": torch.zeros(2, 3), "id": ["a", "b"], "meta": {"text": "t", "n": 1}}


def _unread_after(read):
    reads = BatchReads()
    args, kwargs = reads.watch((_batch(), 3), {"flag": "x", "cfg": {"k": "v"}})
    read(args[0])
    unread = reads.unread()
    assert "[1]['cfg']['k']" in unread  # inside a keyword argument's dict, never fetched
    return unread - {"[1]['cfg']['k']"}


ALL = {"[0][0]['id']", "[0][0]['meta']"}  # the outermost entries without tensors; input_ids holds one
NESTED = {"[0][0]['meta']['text']", "[0][0]['meta']['n']"}


def test_unread_entries_are_the_outermost_without_tensors_and_arguments_count_as_read():
    assert _unread_after(lambda b: None) == ALL


def test_fetching_an_entry_reads_it_and_leaves_what_is_below_it_to_its_own_fetches():
    assert _unread_after(lambda b: b["input_ids"]) == ALL
    assert _unread_after(lambda b: b["id"]) == {"[0][0]['meta']"}
    assert _unread_after(lambda b: b["meta"]) == {"[0][0]['id']"} | NESTED  # a dict: its entries not yet
    assert _unread_after(lambda b: b["meta"]["n"]) == {"[0][0]['id']", "[0][0]['meta']['text']"}
    assert _unread_after(lambda b: b.get("id")) == {"[0][0]['meta']"}
    assert _unread_after(lambda b: "id" in b and len(b) and list(b)) == ALL  # keys are structure


def test_entries_holding_tensors_are_never_unread():
    reads = BatchReads()
    reads.watch(({"pair": [torch.zeros(1), "tag"], "tag": "t"},), {})
    assert reads.unread() == {"[0][0]['tag']"}


def _star(**kw):
    return kw


@pytest.mark.parametrize("read, unread", [
    (lambda b: [v for v in b.values()], NESTED),  # the nested dict comes back watched: its entries not yet read
    (lambda b: {k: v for k, v in b.items()}, NESTED),
    (lambda b: _star(**b) and _star(**b["meta"]), set()),
    (lambda b: dict(b) and dict(b["meta"]), set()),
    (lambda b: {**b, **b["meta"]}, set()),
    (lambda b: b.copy(), set()),
    (lambda b: repr(b), set()),
    (lambda b: b == {}, set()),
    (lambda b: b | {}, set()),
    (lambda b: copy.deepcopy(b), set()),
    (lambda b: pickle.dumps(b), set()),
    (lambda b: pytree.tree_map(lambda x: x, b), set()),
    (lambda b: pytree.tree_leaves(b), set()),
    (lambda b: [b.pop("id"), b["meta"].pop("text")], {"[0][0]['meta']['n']"}),
    (lambda b: b.setdefault("id") and b["meta"].get("n"), {"[0][0]['meta']['text']"}),
], ids=["values", "items", "star-star", "dict()", "unpack", "copy", "repr", "eq", "or", "deepcopy", "pickle",
        "tree_map", "tree_leaves", "pop", "setdefault-get"])
def test_every_way_of_reading_the_values_counts(read, unread):
    assert _unread_after(read) == unread


def test_the_fingerprint_keys_an_unread_entry_as_a_marker_unless_it_now_holds_tensors():
    unread = frozenset({"[0][0]['id']"})
    a, _ = without_unread(({"x": torch.zeros(1), "id": ["a", "b", "c"]},), {}, unread)
    b, _ = without_unread(({"x": torch.zeros(1), "id": ["d"]},), {}, unread)
    assert a[0]["id"] == b[0]["id"] == NOT_READ  # values and length alike
    c, _ = without_unread(({"x": torch.zeros(1), "id": [torch.zeros(1)]},), {}, unread)
    assert isinstance(c[0]["id"][0], torch.Tensor)


def test_a_rebuilt_batch_behaves_as_a_dict_and_records_nothing():
    reads = BatchReads()
    (b,), _ = reads.watch((_batch(),), {})
    moved = type(b)({k: v for k, v in b.items()})  # accelerate's send_to_device, transformers' _prepare_input
    assert isinstance(moved, dict) and moved["id"] == ["a", "b"] and isinstance(b, WatchedDict)
    assert pytree.tree_leaves(moved)[0] is b["input_ids"]

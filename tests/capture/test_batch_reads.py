"""capture/batch_reads.py: which entries of the batch dicts a step fetches.
A value is left out of the fingerprint only if no way of reading it was
taken, so every way Python code reads a dict must count as a fetch."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.utils._pytree as pytree

from stepfx.capture.batch_reads import BatchReads, WatchedDict


def _batch():
    return {"input_ids": torch.zeros(2, 3), "id": ["a", "b"], "meta": {"text": "t", "n": 1}}


def _leaf_paths(args, kwargs):
    return [pytree.keystr(p) for p, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]
            if not isinstance(leaf, torch.Tensor)]


def _unread_after(read):
    reads = BatchReads()
    args, kwargs = reads.watch((_batch(), 3), {"flag": "x", "cfg": {"k": "v"}})
    read(args[0])
    unread = reads.unread(_leaf_paths((_batch(), 3), {"flag": "x", "cfg": {"k": "v"}}))
    assert "[1]['cfg']['k']" in unread  # inside a keyword argument's dict, never fetched
    return unread - {"[1]['cfg']['k']"}


ALL_OF_THE_BATCH = {"[0][0]['id'][0]", "[0][0]['id'][1]", "[0][0]['meta']['text']", "[0][0]['meta']['n']"}


def test_paths_follow_pytree_and_arguments_themselves_count_as_read():
    # nothing fetched: the batch dict's constants and the keyword dict's entry are unread; 3 and "x" are arguments
    assert _unread_after(lambda b: None) == ALL_OF_THE_BATCH


def test_fetching_an_entry_reads_what_is_below_it_only():
    assert _unread_after(lambda b: b["input_ids"]) == ALL_OF_THE_BATCH
    assert _unread_after(lambda b: b["id"]) == {"[0][0]['meta']['text']", "[0][0]['meta']['n']"}
    assert _unread_after(lambda b: b["meta"]) == ALL_OF_THE_BATCH - {"[0][0]['meta']"}  # a dict: its entries not yet
    assert _unread_after(lambda b: b["meta"]["n"]) == ALL_OF_THE_BATCH - {"[0][0]['meta']['n']"}
    assert _unread_after(lambda b: b.get("id")) == {"[0][0]['meta']['text']", "[0][0]['meta']['n']"}
    assert _unread_after(lambda b: "id" in b and len(b) and list(b)) == ALL_OF_THE_BATCH  # keys are structure


def _star(**kw):
    return kw


NESTED = {"[0][0]['meta']['text']", "[0][0]['meta']['n']"}


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


def test_a_rebuilt_batch_behaves_as_a_dict_and_records_nothing():
    reads = BatchReads()
    (b,), _ = reads.watch((_batch(),), {})
    moved = type(b)({k: v for k, v in b.items()})  # accelerate's send_to_device, transformers' _prepare_input
    assert isinstance(moved, dict) and moved["id"] == ["a", "b"] and isinstance(b, WatchedDict)
    assert pytree.tree_leaves(moved)[0] is b["input_ids"]

"""Which values of the step's batch dicts the step reads while traced.

A batch often carries what the step never looks at: each example's id,
its text kept for logging, a dataset index. Every leaf of the arguments
that is not a tensor is a constant of the captured step, so a new value
used to mean a new capture (at every call, for an id). The dicts among
the arguments are handed to the step, while it is traced, as
``WatchedDict``: a ``dict`` with the same items that records which
entries the code fetched (``d[k]``, ``get``, ``items``, ``values``,
``pop``, ``**d``, a copy, a comparison, ``repr``, pickling, torch's
pytree). A value under an entry never fetched cannot have changed the
graph: ``fingerprint`` keys the entry as a marker (its value and its
structure: a list of ids as long as the batch), and a call that differs
only there runs the plan already made. Entries holding tensors are kept:
their tensors are the graph's inputs, in order.

Only ``dict`` instances are watched (exactly ``dict``, as torch's pytree
flattens them); the step's own arguments, and the elements of lists and
tuples, count as read. What bypasses the dict's methods is not seen:
C code reading a ``dict`` subclass through ``PyDict_GetItem`` or
``PyDict_Next`` (CPython's ``**`` and ``dict(d)`` use the methods,
because ``__iter__`` is overridden here).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["BatchReads", "WatchedDict", "without_unread", "NOT_READ"]


class BatchReads:
    """The entries (pytree key paths, as ``pytree.keystr`` spells them)
    of the watched dicts, and those the traced step fetched."""

    def __init__(self) -> None:
        self.entries: dict[str, bool] = {}  # entry path -> whether tensors lie below it
        self.fetched: set[str] = set()

    def watch(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with every dict inside them watched. The
        paths follow ``pytree.tree_flatten_with_path((args, kwargs))``."""
        return (tuple(self._wrap(a, f"[0][{i}]") for i, a in enumerate(args)),
                {k: self._wrap(v, f"[1][{k!r}]") for k, v in kwargs.items()})

    def _wrap(self, x: Any, path: str) -> Any:
        if type(x) is dict:
            items = {}
            for k, v in x.items():
                self.entries[f"{path}[{k!r}]"] = any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(v))
                items[k] = self._wrap(v, f"{path}[{k!r}]")
            return WatchedDict(items, _reads=self, _path=path)
        if type(x) in (list, tuple):
            return type(x)(self._wrap(v, f"{path}[{i}]") for i, v in enumerate(x))
        return x

    def unread(self) -> frozenset[str]:
        """The entries the step never fetched that hold no tensor (a
        tensor is a graph input: its place among them must stay), the
        outermost of them."""
        missed = [e for e, tensors in self.entries.items() if e not in self.fetched and not tensors]
        return frozenset(e for e in missed if not any(e.startswith(o + "[") for o in missed))


def without_unread(args: tuple, kwargs: dict, unread: frozenset[str]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the values of the ``unread`` entries (paths
    as :meth:`BatchReads.watch` spells them) replaced by a marker, where
    they hold no tensor now either: what ``fingerprint`` keys a call on."""
    if not unread:
        return args, kwargs

    def mask(x: Any, path: str) -> Any:
        if type(x) is dict:
            out = {}
            for k, v in x.items():
                entry = f"{path}[{k!r}]"
                if entry in unread and not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(v)):
                    out[k] = NOT_READ
                else:
                    out[k] = mask(v, entry)
            return out
        if type(x) in (list, tuple):
            return type(x)(mask(v, f"{path}[{i}]") for i, v in enumerate(x))
        return x

    return (tuple(mask(a, f"[0][{i}]") for i, a in enumerate(args)),
            {k: mask(v, f"[1][{k!r}]") for k, v in kwargs.items()})


NOT_READ = "<not read by the step>"  # what an unread entry's value is keyed as (structure included)


class WatchedDict(dict):
    """A dict of the batch while the step is traced: fetching an entry
    records it (see the module's docstring). Built from a mapping like any
    dict (``type(d)({...})``, as accelerate and transformers rebuild
    batches), it records nothing."""

    def __init__(self, *args, _reads: BatchReads | None = None, _path: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self._reads, self._path = _reads, _path

    def _fetch(self, key) -> None:
        if self._reads is not None:
            self._reads.fetched.add(f"{self._path}[{key!r}]")

    def _fetch_all(self) -> None:
        for key, value in dict.items(self):
            self._fetch(key)
            if isinstance(value, WatchedDict):
                value._fetch_all()

    def __getitem__(self, key):
        value = dict.__getitem__(self, key)
        self._fetch(key)
        return value

    def get(self, key, default=None):
        if key in self:
            self._fetch(key)
        return dict.get(self, key, default)

    def pop(self, key, *default):
        if key in self:
            self._fetch(key)
        return dict.pop(self, key, *default)

    def setdefault(self, key, default=None):
        if key in self:
            self._fetch(key)
        return dict.setdefault(self, key, default)

    def popitem(self):
        key, value = dict.popitem(self)
        self._fetch(key)
        return key, value

    def items(self):
        for key in dict.keys(self):
            self._fetch(key)
        return dict.items(self)

    def values(self):
        for key in dict.keys(self):
            self._fetch(key)
        return dict.values(self)

    def __iter__(self):  # keys only; overridden so CPython's ** and dict(d) fetch through __getitem__
        return dict.__iter__(self)

    def copy(self):
        self._fetch_all()
        return dict(dict.items(self))

    def __eq__(self, other):
        self._fetch_all()
        return dict.__eq__(self, other)

    def __ne__(self, other):
        self._fetch_all()
        return dict.__ne__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self):
        self._fetch_all()
        return dict.__repr__(self)

    def __or__(self, other):
        self._fetch_all()
        return dict(dict.items(self)) | other

    def __ror__(self, other):
        self._fetch_all()
        return other | dict(dict.items(self))

    def __reduce_ex__(self, protocol):
        self._fetch_all()
        return (dict, (dict(dict.items(self)),))


def _flatten(d: WatchedDict):
    d._fetch_all()
    return list(dict.values(d)), list(dict.keys(d))


def _flatten_with_keys(d: WatchedDict):
    d._fetch_all()
    return [(pytree.MappingKey(k), v) for k, v in dict.items(d)], list(dict.keys(d))


pytree.register_pytree_node(WatchedDict, _flatten, lambda values, keys: dict(zip(keys, values)),
                            serialized_type_name="stepfx.capture.batch_reads.WatchedDict",
                            flatten_with_keys_fn=_flatten_with_keys)

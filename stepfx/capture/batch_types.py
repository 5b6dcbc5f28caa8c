"""Batch containers torch's pytree does not open, opened.

stepfx finds the step's batch tensors by flattening its arguments with
torch's pytree, which opens dicts, lists, tuples and named tuples and
treats anything else as one constant leaf. Two containers that carry
real batches were such leaves, so their tensors were no inputs of the
step and capture refused with "a tensor that is not ... an argument of
the step" (found 2026-12-06 trying Hugging Face's DataCollatorWithPadding
as a new user):

- ``collections.UserDict`` subclasses: transformers' ``BatchEncoding``
  (what tokenizers and ``DataCollatorWithPadding`` return) and
  ``BatchFeature`` (image and audio processors);
- dataclass instances (a training loop's own ``Batch`` type).

Only containers that hold tensors are opened: one without any (a settings
dataclass passed to the step) stays a constant leaf, as before.

:func:`open_batch_containers` registers each such type it finds among
the arguments with torch's pytree, once and for the whole process (torch's
pytree then opens them everywhere, as it opens dicts): the children are the dict's
items or the dataclass's fields, in order, and the step gets an
instance of the same type back (built without calling ``__init__``:
other attributes of a ``UserDict`` are set to None, as a ``BatchEncoding``
made by ``tokenizer.pad`` has them; a dataclass's fields are set as they
are, frozen ones included, without ``__post_init__``).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["open_batch_containers"]

_OPENED: set[type] = set()


def open_batch_containers(args: tuple, kwargs: dict) -> None:
    """Register with torch's pytree the UserDict and dataclass types found
    among ``args`` and ``kwargs`` (inside dicts, lists, tuples and each
    other). Called at every step: a type already opened is not searched for
    tensors again."""
    stack: list[Any] = [list(args), list(kwargs.values())]
    while stack:
        x = stack.pop()
        children = _children(x)
        if children is None:
            continue
        kind = type(x)
        if kind not in _OPENED and _is_container(x) and _holds_tensors(x):
            _open(kind, _user_dict_node(kind, x) if isinstance(x, collections.UserDict) else _dataclass_node(kind))
        stack.extend(children)


def _is_container(x: Any) -> bool:
    """A UserDict or a dataclass instance: what this module opens."""
    return isinstance(x, collections.UserDict) or (dataclasses.is_dataclass(x) and not isinstance(x, type))


def _children(x: Any) -> list | None:
    """What ``x`` holds, if it is a list, tuple, dict, UserDict or dataclass instance; else None."""
    if isinstance(x, (list, tuple)):
        return list(x)
    if isinstance(x, dict):
        return list(x.values())
    if isinstance(x, collections.UserDict):
        return list(x.data.values())
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [getattr(x, f.name) for f in dataclasses.fields(x)]
    return None


def _holds_tensors(x: Any) -> bool:
    """Whether tensors lie inside ``x`` (a container without any, a
    settings dataclass say, stays one constant leaf as before)."""
    stack = [x]
    while stack:
        y = stack.pop()
        if isinstance(y, torch.Tensor):
            return True
        stack.extend(_children(y) or ())
    return False


def _open(kind: type, node: tuple | None) -> None:
    if kind in _OPENED or node is None:
        return
    if kind in pytree.SUPPORTED_NODES:  # someone (transformers, the user) registered it already
        _OPENED.add(kind)
        return
    flatten, unflatten, with_keys = node
    pytree.register_pytree_node(kind, flatten, unflatten, flatten_with_keys_fn=with_keys,
                                serialized_type_name=f"{kind.__module__}.{kind.__qualname__}")
    _OPENED.add(kind)


def _user_dict_node(kind: type, example: collections.UserDict):
    others = tuple(sorted(name for name in vars(example) if name != "data"))

    def flatten(d):
        return list(d.data.values()), list(d.data.keys())

    def with_keys(d):
        return [(pytree.MappingKey(k), v) for k, v in d.data.items()], list(d.data.keys())

    def unflatten(values, keys):
        d = kind.__new__(kind)
        for name in others:
            object.__setattr__(d, name, None)
        object.__setattr__(d, "data", dict(zip(keys, values)))
        return d

    return flatten, unflatten, with_keys


def _dataclass_node(kind: type):
    names = [f.name for f in dataclasses.fields(kind)]

    def flatten(d):
        return [getattr(d, n) for n in names], None

    def with_keys(d):
        return [(pytree.GetAttrKey(n), getattr(d, n)) for n in names], None

    def unflatten(values, _):
        d = kind.__new__(kind)
        for name, value in zip(names, values):
            object.__setattr__(d, name, value)
        return d

    return flatten, unflatten, with_keys

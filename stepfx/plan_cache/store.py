"""Plans on disk: where, in what format, and when an entry is not to be trusted.

Layout under the cache directory (``stepfx.cache_dir``, else
``$STEPFX_CACHE_DIR``, else ``~/.cache/stepfx``)::

    plans/<sha256 of the key>.plan    one captured-and-passed plan of one rank
    inductor/                         TORCHINDUCTOR_CACHE_DIR, unless set
    triton/                           TRITON_CACHE_DIR, unless set

An entry is ``MAGIC``, one JSON header line (format version, the key's
digest, the payload's length and SHA-256, the torch version) and the
payload: a :class:`CachedPlan` written by ``compat.dump_graphs`` (a
pickle). Writes go to a temporary file in ``plans/`` and are renamed into
place, so readers (other ranks, other jobs) see a whole entry or none, and
concurrent writers of one key leave one of their equal entries.

Trust: a pickle runs code when it is loaded, so entries are read only from
a directory owned by the current user that its group and others cannot
write to, and only files owned by the current user; otherwise the cache is
off for the run, with a warning saying why and how to fix it. An entry
whose magic, format, key or checksum does not match, or that fails to load
or to pass the step-graph checks, is ignored with a warning and rewritten
by the capture that follows: never a wrong plan, at worst a capture.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .. import compat
from ..graph import META_SOURCE, StepGraph, verify_step_graph
from .key import PlanKey, file_digest

__all__ = ["FORMAT", "CACHE_ENV", "CachedPlan", "PlanCache", "traced_files"]

log = logging.getLogger("stepfx")

FORMAT = 1  # bump when CachedPlan or the header changes meaning
MAGIC = b"stepfx plan\n"
CACHE_ENV = "STEPFX_CACHE_DIR"
_OFF_VALUES = frozenset({"", "0", "off", "false", "no"})
# the compilers' own on-disk caches, moved under the plan cache unless the user placed them
_COMPILER_CACHES = (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"))
_FILE_OF_SOURCE = re.compile(r"^(?P<file>.+?):\d+(?: in |: |$)")


@dataclass
class CachedPlan:
    """What a warm start needs instead of capture and passes.

    ``graph``: the final step graph (fake-tensor metadata included: the
    executor, CUDA-graph partition and explain() read it); ``records``:
    (index, name, changed, seconds, summary, skipped) of every pass;
    ``held``/``stepped``/``param_numels``: what the step object derives from
    the captured graph (``api._build_plan``); ``regions``: the inductor
    regions the graph calls (``codegen.regions.regions_of``); ``guard``:
    the symbolic variant's :class:`~stepfx.capture.dynamic.BatchShapeGuard`;
    ``batch_shapes``/``dynamic``: the capture's batch shapes and whether
    symbolic sizes were asked for; ``sources``: path -> content digest of
    every source file the trace ran through (the user's, libraries'),
    compared again when loading."""

    graph: StepGraph
    records: tuple[tuple, ...]
    held: dict
    stepped: frozenset[str]
    param_numels: dict[str, int]
    regions: dict
    guard: Any
    batch_shapes: dict
    dynamic: bool
    sources: dict[str, str]
    capture_seconds: float
    passes_seconds: float
    key_items: tuple = ()
    loaded_from: str | None = field(default=None, compare=False)

    def changed_source(self) -> str | None:
        """A source file that changed (or went) since the plan was written."""
        for path, digest in self.sources.items():
            if file_digest(path) != digest:
                return path
        return None


def traced_files(graph: StepGraph) -> set[str]:
    """The source files of the user frames the capture recorded on nodes
    (``meta["source"]``: ``file:line in func: code``)."""
    files = set()
    for node in graph.gm.graph.nodes:
        source = node.meta.get(META_SOURCE)
        if source and (m := _FILE_OF_SOURCE.match(source)) and os.path.isfile(m["file"]):
            files.add(os.path.abspath(m["file"]))
    return files


class _Unreadable(Exception):
    """Why an entry on disk is not used."""


class PlanCache:
    """One step's view of the on-disk plan cache. ``root`` is None when the
    cache is off; ``why_off`` then says why (explain() shows it)."""

    def __init__(self, root: str | None, why_off: str | None = None, moved: tuple[str, ...] = ()):
        self.root = root
        self.why_off = why_off
        self.moved = moved  # compiler cache variables this process set to folders under root

    @property
    def enabled(self) -> bool:
        return self.root is not None

    @classmethod
    def open(cls, setting: str | bool | None, env: Mapping[str, str] | None = None) -> "PlanCache":
        """The cache ``stepfx.cache_dir`` asks for (``env``: the process
        environment, read here at the step's first call). Creates the
        directory (mode 0700) and refuses one that is not safe to load
        pickles from. When on, points inductor's and Triton's caches under
        it unless their variables are set."""
        env = os.environ if env is None else env
        if setting is False:
            return cls(None, "off (stepfx.cache_dir is false)")
        if isinstance(setting, str):
            root = setting
        elif CACHE_ENV in env:
            if env[CACHE_ENV].strip().lower() in _OFF_VALUES:
                return cls(None, f"off ({CACHE_ENV}={env[CACHE_ENV]!r})")
            root = env[CACHE_ENV]
        else:
            root = os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "stepfx")
        root = os.path.abspath(os.path.expanduser(root))
        plans = os.path.join(root, "plans")
        try:
            os.makedirs(plans, mode=0o700, exist_ok=True)
        except OSError as exc:
            log.warning("stepfx: not using the plan cache: cannot create %s (%s)", plans, exc)
            return cls(None, f"off: cannot create {plans} ({exc})")
        for path in (root, plans):
            why = unsafe_directory(path)
            if why is not None:
                log.warning(
                    "stepfx: not using the plan cache at %s: %s. Plans are pickles, and loading a pickle runs code, "
                    "so stepfx reads them only from a directory that you own and no one else can write to: run "
                    "`chmod go-w %s` (and chown it if needed), or set stepfx.cache_dir (or %s) to such a directory",
                    root, why, path, CACHE_ENV)
                return cls(None, f"refused: {why}")
        moved = []
        for var, sub in _COMPILER_CACHES:
            if var not in os.environ:
                os.environ[var] = os.path.join(root, sub)
                moved.append(var)
        return cls(root, None, tuple(moved))

    def path(self, key: PlanKey) -> str:
        return os.path.join(self.root, "plans", f"{key.digest}.plan")

    # -- reading ------------------------------------------------------------
    def load(self, key: PlanKey) -> tuple[CachedPlan | None, str]:
        """The entry filed under ``key`` (None when absent or not to be
        trusted) and a note on what happened."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                why = unsafe_file(os.fstat(f.fileno()), path)
                if why is not None:
                    log.warning("stepfx: ignoring the cached plan %s: %s (plans are pickles)", path, why)
                    return None, f"entry refused: {why}"
                data = f.read()
        except FileNotFoundError:
            return None, "not in the cache"
        except OSError as exc:
            log.warning("stepfx: cannot read the cached plan %s (%s); capturing again", path, exc)
            return None, f"entry unreadable ({exc})"
        try:
            entry = _decode(data, key)
        except _Unreadable as exc:
            log.warning("stepfx: ignoring the cached plan %s (%s); capturing again, which rewrites it", path, exc)
            return None, f"entry ignored ({exc})"
        changed = entry.changed_source()
        if changed is not None:
            return None, f"{changed} changed since the plan was cached"
        entry.loaded_from = path
        return entry, "loaded"

    # -- writing ------------------------------------------------------------
    def save(self, key: PlanKey, entry: CachedPlan) -> str:
        """Write ``entry`` under ``key`` (atomically); a note on what happened."""
        try:
            payload = compat.dump_graphs(entry)
        except compat.GraphsNotSerializable as exc:
            return f"not cached: the plan cannot be written ({exc})"
        header = json.dumps({"format": FORMAT, "key": key.digest, "bytes": len(payload),
                             "sha256": hashlib.sha256(payload).hexdigest(), "torch": torch.__version__,
                             "written": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode()
        folder = os.path.dirname(self.path(key))
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key.digest[:16]}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + header + b"\n")
                f.write(payload)
            os.replace(tmp, self.path(key))  # atomic: readers see the old entry or this one
            tmp = None
        except OSError as exc:
            log.warning("stepfx: could not write the plan to the cache (%s); it runs uncached", exc)
            return f"not cached: writing failed ({exc})"
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        return f"saved ({len(payload) / 2**20:.1f} MiB)"


def _decode(data: bytes, key: PlanKey) -> CachedPlan:
    if not data.startswith(MAGIC):
        raise _Unreadable("not a stepfx plan file")
    end = data.find(b"\n", len(MAGIC))
    if end < 0:
        raise _Unreadable("truncated header")
    try:
        header = json.loads(data[len(MAGIC):end])
    except ValueError as exc:
        raise _Unreadable(f"bad header: {exc}") from exc
    payload = data[end + 1:]
    if header.get("format") != FORMAT:
        raise _Unreadable(f"format {header.get('format')}, this stepfx reads {FORMAT}")
    if header.get("key") != key.digest:
        raise _Unreadable("filed under another key")
    if header.get("bytes") != len(payload) or header.get("sha256") != hashlib.sha256(payload).hexdigest():
        raise _Unreadable("checksum mismatch (a partial or damaged file)")
    try:
        entry = compat.load_graphs(payload)
    except Exception as exc:  # whatever a damaged or foreign pickle raises: not this plan
        raise _Unreadable(f"loading failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}") from exc
    if not isinstance(entry, CachedPlan) or not isinstance(entry.graph, StepGraph):
        raise _Unreadable(f"holds a {type(entry).__name__}, not a plan")
    problems = verify_step_graph(entry.graph)
    if problems:
        raise _Unreadable(f"the graph fails its checks: {problems[0]}")
    return entry


def unsafe_directory(path: str) -> str | None:
    """Why pickles must not be loaded from directory ``path`` (None: safe):
    another user owns it, or its group or anyone may write to it."""
    if not hasattr(os, "getuid"):  # pragma: no cover - no POSIX owners (Windows)
        return None
    return _unsafe(os.stat(path), path)


def unsafe_file(st: os.stat_result, path: str) -> str | None:
    if not hasattr(os, "getuid"):  # pragma: no cover
        return None
    return _unsafe(st, path)


def _unsafe(st: os.stat_result, path: str) -> str | None:
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"{path} can be written by its group or by anyone (mode {st.st_mode & 0o777:o})"
    return None


"""Shared Dynamo traces on disk: `traces/<key>/` beside the compile cache's entries (npu_graph.cache.traces says
what a trace is and when it is shared).

A trace folder holds trace.pkl (torch's caching-precompile package, pickled), meta.json and `tag`: the entry format
of npu_graph.cache.folder, with meta.json's "kind" = "trace". It is written whole in tmp/ and renamed into place, and
read with every trust check made on the very bytes that are then used: only a folder whose tag verifies under the
user's key is ever unpickled. A folder without trace.pkl is a marker: "this function's trace depends on the rank"
(meta.json's "per_rank"), so each rank keeps its own under a key of its own. A folder that fails a check is
quarantined with one warning; the function is then traced as if there were none. The lease of a trace is
`locks/trace-<key>.lease` (npu_graph.cache.locks).
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.precompile_context import BackendCacheArtifact

from npu_graph.cache.disk_store import DiskCache
from npu_graph.cache.folder import CorruptEntry, read_folder, verify_entry, write_entry
from npu_graph.cache.lease import Lease
from npu_graph.cache.locks import CacheWarning, Work, take_lease
from npu_graph.cache.trust import ensure_private_dir

TRACE_FILE = "trace.pkl"
_KEY = re.compile(r"[0-9a-f]{64}")


def trace_work(key: str) -> Work:
    return Work(f"tracing the same function with Dynamo (trace {key[:12]})", f"the lease of trace {key[:12]}",
                "tracing it without waiting (set ASCEND_DSA_CACHE_LOCK_TIMEOUT to wait longer)")


class TraceShelf:
    """The traces of one cache tree."""

    def __init__(self, disk: DiskCache):
        self.disk = disk
        self.root = os.path.join(disk.base, "traces")

    def folder(self, key: str) -> str:
        if not _KEY.fullmatch(key):
            raise ValueError(f"not a trace key: {key!r}")
        return os.path.join(self.root, key)

    def keys(self) -> list[str]:
        try:
            return sorted(name for name in os.listdir(self.root) if _KEY.fullmatch(name))
        except OSError:
            return []

    def lease(self, key: str) -> Lease | None:
        """The trace's lease, or None when the trace was stored meanwhile, its holder gave it up without storing
        one (the caller then traces without a lease), or it was held past the timeout (one warning)."""
        path = os.path.join(self.disk.base, "locks", f"trace-{key}.lease")
        seen = []

        def done() -> bool:
            seen.append(os.path.lexists(path))
            return os.path.lexists(self.folder(key)) or (any(seen) and not seen[-1])

        return take_lease(path, trace_work(key), self.disk.lock_timeout, done, self.disk.lease_stale)

    def _checked(self, key: str) -> tuple[dict[str, Any], bytes | None]:
        entry = read_folder(self.folder(key), (TRACE_FILE,))
        meta = verify_entry(key, entry, [self.disk.key], required=())
        if meta.get("kind") != "trace":
            raise CorruptEntry("it is not a trace")
        return meta, entry.files.get(TRACE_FILE)

    def _quarantine(self, key: str) -> bool:
        try:
            os.rename(self.folder(key), os.path.join(self.disk.base, "quarantine", f"trace-{key}-{time.time_ns()}"))
        except OSError:
            return False
        return True

    def read(self, key: str) -> tuple[dict[str, Any], bytes | None] | None:
        """(meta.json, the pickled package or None for a per-rank marker) after every check; None when there is
        no trace, or it failed a check (quarantined, one warning)."""
        if self.disk.key is None or not os.path.lexists(self.folder(key)):
            return None
        try:
            return self._checked(key)
        except CorruptEntry as exc:
            if os.path.lexists(self.folder(key)):
                where = "moved to quarantine" if self._quarantine(key) else "left in place"
                warnings.warn(f"ascend_dsa cache: trace {key[:12]} is not used: {exc}; {where}, tracing",
                              CacheWarning, stacklevel=3)
            return None

    def write(self, key: str, package: bytes | None, meta: dict[str, Any]) -> bool:
        """Store a trace (or, with `package` None, a per-rank marker) whole, in place of one stored before;
        False when the cache cannot be written (one warning, the first time)."""
        if self.disk.read_only is not None or self.disk.key is None:
            return False
        try:
            ensure_private_dir(self.root)
            tmp = tempfile.mkdtemp(prefix=f"trace-{key[:12]}-", dir=os.path.join(self.disk.base, "tmp"))
        except OSError as exc:
            self.disk.cannot_write(exc)
            return False
        try:
            files = {} if package is None else {TRACE_FILE: package}
            write_entry(tmp, key, files, {**meta, "kind": "trace", "created": time.time()}, self.disk.key)
            self._retire(key)
            os.rename(tmp, self.folder(key))
            return True
        except OSError as exc:
            if not os.path.lexists(self.folder(key)):
                self.disk.cannot_write(exc)
            return False
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _retire(self, key: str) -> None:
        aside = os.path.join(self.disk.base, "tmp", f"trace-{key[:12]}-retired-{time.time_ns()}")
        try:
            os.rename(self.folder(key), aside)
        except FileNotFoundError:
            return
        shutil.rmtree(aside, ignore_errors=True)

    def verify(self) -> tuple[int, list[dict[str, Any]]]:
        """(traces that verify, [{key, problem, quarantined}] for those that do not), as `cache verify` reports."""
        good, bad = 0, []
        for key in self.keys():
            try:
                self._checked(key)
                good += 1
            except CorruptEntry as exc:
                if os.path.lexists(self.folder(key)):
                    bad.append({"key": key, "problem": str(exc), "quarantined": self._quarantine(key)})
        return good, bad

    def clear(self) -> dict[str, str]:
        """Remove every trace; {key: why it is still there}."""
        left = {}
        for key in self.keys():
            try:
                shutil.rmtree(self.folder(key))
            except OSError as exc:
                left[key] = f"{type(exc).__name__}: {exc.strerror or exc}"
        return left


class GraphOfTrace:
    """A graph of a shared trace: its compile-cache entry, and Dynamo's graph pickled for the eager fallback of a
    fused op whose inputs break its preconditions (rebuilt only then). `compiled` is set when loaded."""

    def __init__(self, key: str, gm: torch.fx.GraphModule | None):
        self.key, self._gm, self._eager = key, gm, b""
        self.compiled: Callable[..., Any] | None = None

    def __deepcopy__(self, memo: dict) -> GraphOfTrace:   # torch copies artifacts when they are recorded
        return self

    def __getstate__(self) -> dict[str, Any]:
        return {"key": self.key, "eager": self._eager or pickle.dumps(self._gm)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.key, self._eager, self._gm, self.compiled = state["key"], state["eager"], None, None

    def eager(self, *args: Any) -> Any:
        if self._gm is None:
            self._gm = pickle.loads(self._eager)     # from a package whose tag verified
        return self._gm(*args)


class TraceGraph(BackendCacheArtifact):
    """The backend artifact of one graph of a package (key: Dynamo's name for the compiled graph)."""

    def after_deserialization(self) -> Callable[..., Any]:
        if self.content.compiled is None:
            raise RuntimeError(f"ascend_dsa: graph {self.content.key[:12]} of a shared trace was not loaded")
        return self.content.compiled

"""The traces this process makes for the others (npu_graph.cache.traces): each waits, with the lease of its key,
until the compiles of the call that traces it have paused for QUIET_S seconds (or, before any compile began,
START_S seconds after torch.compile), and is then stored and its lease released, by one thread; at exit, whatever
is pending is stored at once. A trace that meets torch.distributed while it is made moves to this rank's own key at
once (a marker under the shared key lets the waiters go), and one holding a graph only this process can load is
dropped (the waiters then trace)."""
from __future__ import annotations

import dataclasses
import pickle
import threading
import time
import warnings
from typing import Any

import torch._dynamo.package as dynamo_package
from torch._dynamo.precompile_context import PrecompileContext

from npu_graph.cache import trace_watch
from npu_graph.cache.key import versions
from npu_graph.cache.lease import Lease
from npu_graph.cache.trace_store import TraceGraph, TraceShelf

QUIET_S = 1.0
START_S = 5.0


@dataclasses.dataclass
class Pending:
    """A trace this process makes and will store."""
    shelf: TraceShelf
    key: str
    lease: Lease | None
    function: str
    thread: int = dataclasses.field(default_factory=threading.get_ident)
    since: float = dataclasses.field(default_factory=time.monotonic)
    package: Any = None
    started: bool = False
    per_rank: bool = False


class State:
    """What this process shares: the pending traces (by their package), compiles in flight, the settling thread."""

    def __init__(self) -> None:
        self.installed = False
        self.lock = threading.RLock()
        self.pending: dict[int, Pending] = {}
        self.compiling = 0
        self.thread: threading.Thread | None = None
        self.warned: set[str] = set()       # functions whose trace could not be stored, warned about once


STATE = State()


def making(key: str) -> bool:
    with STATE.lock:
        return any(p.key == key for p in STATE.pending.values())


def recorded(package: Any) -> bool:
    """Dynamo compiled a frame of `package`'s function; whether it is a trace this process will store."""
    met_distributed = trace_watch.take_flag()
    with STATE.lock:
        pending = STATE.pending.get(id(package))
        if pending is not None:
            pending.package = package
            if met_distributed:
                _keep_per_rank(pending)
        return pending is not None


def _keep_per_rank(pending: Pending) -> None:
    """The trace depends on the rank: mark its shared key so, let the waiters go, and keep it under this rank's."""
    pending.per_rank = True
    if pending.lease is None:
        return
    pending.shelf.write(pending.key, None, {"per_rank": True, "function": pending.function})
    pending.lease.release()
    pending.key, pending.lease = trace_watch.rank_key(pending.key), None


def met_distributed_now() -> None:
    """Called by trace_watch as a trace meets torch.distributed: this thread's traces are kept per rank."""
    with STATE.lock:
        for pending in STATE.pending.values():
            if pending.thread == threading.get_ident() and not pending.per_rank:
                _keep_per_rank(pending)


def graph_not_shared() -> None:
    """The backend got a graph that only this process can load (rewritten to be rank-free): this thread's traces
    are not stored, and whoever waits for them traces at once."""
    with STATE.lock:
        for ident, pending in list(STATE.pending.items()):
            if pending.thread == threading.get_ident():
                del STATE.pending[ident]
                if pending.lease is not None:
                    pending.lease.release()


def compile_started() -> None:
    with STATE.lock:
        STATE.compiling += 1
        for pending in STATE.pending.values():
            pending.started = True


def compile_ended() -> None:
    with STATE.lock:
        STATE.compiling -= 1
        for pending in STATE.pending.values():
            pending.since = time.monotonic()


class NotShared(Exception):
    """A graph of the trace has no compile-cache entry."""


class TraceNotStoredWarning(UserWarning):
    """A function's trace could not be kept in the compile cache: a new process traces it again."""


def _store(pending: Pending) -> None:
    """Store a finished trace (when every graph of it is a cache entry), then release its lease; one warning per
    function when it cannot be."""
    try:
        if pending.package is not None:
            entry = _package_entry(pending.package)
            data = pickle.dumps(entry)
            for code in entry.dynamo.codes:          # a package whose guards cannot be read back is not stored
                for guarded in code.guarded_codes:
                    dynamo_package.load_guards_state(guarded.guards_state)
            pending.shelf.write(pending.key, data, {"function": pending.function, "versions": versions()})
    except Exception as exc:    # the trace stays this process's own; others trace
        _not_stored(pending.function, exc)
    finally:
        if pending.lease is not None:
            pending.lease.release()


def _not_stored(function: str, exc: Exception) -> None:
    with STATE.lock:
        if function in STATE.warned:
            return
        STATE.warned.add(function)
    reason = str(exc) if isinstance(exc, NotShared) else f"torch could not serialize it: {type(exc).__name__}: {exc}"
    warnings.warn(f"ascend_dsa: the Dynamo trace of {function} is not kept in the compile cache ({reason}); it runs "
                  f"as compiled, and a new process traces it again", TraceNotStoredWarning, stacklevel=2)


def _package_entry(package: Any) -> dynamo_package.PrecompileCacheEntry:
    entry = package.cache_entry()
    backends = {}
    for backend_id in entry.backend_ids:
        artifact = PrecompileContext.serialize_artifact_by_key(backend_id)
        if not isinstance(artifact, TraceGraph):    # a graph the cache did not store, or another backend's
            raise NotShared(f"its graph {backend_id} is not in the compile cache: it ran eagerly, needs autograd, "
                            f"or could not be stored")
        backends[backend_id] = artifact
    return dynamo_package.PrecompileCacheEntry(entry, backends)


def _due(pending: Pending, now: float) -> bool:
    return STATE.compiling == 0 and now - pending.since >= (QUIET_S if pending.started else START_S)


def _settle_loop() -> None:
    while True:
        with STATE.lock:
            now = time.monotonic()
            for ident, pending in list(STATE.pending.items()):
                if _due(pending, now):
                    del STATE.pending[ident]
                    _store(pending)
            if not STATE.pending:
                STATE.thread = None
                return
        time.sleep(0.1)


def settle_in_background() -> None:
    with STATE.lock:
        if STATE.thread is None:
            STATE.thread = threading.Thread(target=_settle_loop, name="ascend-dsa traces", daemon=True)
            STATE.thread.start()


def settle(timeout: float = 60.0) -> None:
    """Wait until this process's traces are stored (or given up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with STATE.lock:
            if not STATE.pending:
                return
        time.sleep(0.05)


def store_all() -> None:
    """At exit: store what is pending now."""
    with STATE.lock:
        pending, STATE.pending = list(STATE.pending.values()), {}
        for one in pending:
            _store(one)

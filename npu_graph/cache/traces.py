"""Dynamo's traces shared through the compile cache, so that processes sharing a cache folder (a fleet's ranks, on
one host or many) trace a model once, as they compile each of its graphs once.

torch.compile first traces a function's Python with Dynamo (each frame's transformed bytecode, and the guards that
say when it applies), then hands each graph to the backend; the compile cache serves the graphs, this the trace.
It rides on torch's caching precompile (torch._dynamo.package, experimental in torch): with it on, Dynamo keeps
what it made of each frame of a compiled function in a package, and asks a store for one when torch.compile wraps
the function. TraceStore takes the place of torch's store: it serves packages of functions compiled with ascend_dsa
whose graphs all are compile-cache entries (TraceGraph: the entry's key), kept under `traces/`
(npu_graph.cache.trace_store: tagged under the user's key, so only the user's own packages are unpickled).
When a package is loaded, Dynamo does not trace: its guards decide whether the package fits a call (else Dynamo
traces as usual), and each graph is loaded from its entry.

Key (trace_key): the function (module, name, file, first line), for a module's method the module's tree and its
tensors' names, shapes and dtypes, the backend's settings, and the versions and source digest that key the graphs.
A package whose traced sources changed since is not used (and is replaced).

One tracer per key: the first process takes the key's lease when torch.compile wraps the function, the others
wait there (as for an entry, bounded by ASCEND_DSA_CACHE_LOCK_TIMEOUT). The holder stores the package once its
compiles have paused for a second (its first call traced and compiled), and releases the lease; one that
has not begun compiling five seconds after torch.compile releases it too, and the waiters then trace. A holder
that dies or hangs loses its lease (stale heartbeat).

A rank's own place in a torch.distributed run: Dynamo folds `dist.get_rank()`, a group's `rank()` or a device mesh's
coordinates into a trace without a guard. A trace that met anything of torch.distributed (trace_watch) is
therefore kept per rank: a marker under the shared key says so, and each rank stores and loads its own. Graphs the
compiler rewrote to be rank-free (parallel/rank_free.py) need this process's own graph, so a trace holding one is
not stored at all.

On by default in a process torchrun started (TORCHELASTIC_RUN_ID set); ASCEND_DSA_SHARE_TRACES=1 turns it on
anywhere, =0 off. It switches torch._dynamo.config.caching_precompile on for the whole process.
"""
from __future__ import annotations

import atexit
import importlib
import itertools
import logging
import os
import pickle
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo.package as dynamo_package
from torch._dynamo import bytecode_transformation
from torch._dynamo.precompile_context import PrecompileContext

from npu_graph.cache import trace_pending, trace_watch
from npu_graph.cache.key import cache_key, source_digest, versions
from npu_graph.cache.trace_pending import STATE, Pending, making
from npu_graph.cache.trace_store import GraphOfTrace, TraceGraph, TraceShelf

SHARE_ENV = "ASCEND_DSA_SHARE_TRACES"
log = logging.getLogger("npu_graph")


def sharing_requested() -> bool:
    """ASCEND_DSA_SHARE_TRACES (1 or 0), else whether torchrun started this process."""
    text = os.environ.get(SHARE_ENV, "")
    if text not in ("", "0", "1"):
        raise ValueError(f"{SHARE_ENV}={text!r}: use 1 (keep Dynamo's traces in the compile cache, so a new process "
                         f"with a warm cache does not trace) or 0 (every process traces)")
    return text == "1" if text else bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def record_graph(gm: torch.fx.GraphModule, key: str) -> None:
    """Note that Dynamo's graph `gm` is served by cache entry `key`, for the package of the trace it belongs to."""
    backend_id = gm.meta.get("backend_id")
    if STATE.installed and isinstance(backend_id, str):
        PrecompileContext.record_artifact(TraceGraph(backend_id, GraphOfTrace(key, gm)))


def trace_key(fn: Callable[..., Any], settings: str) -> str:
    """The key of `fn`'s trace under backend settings `settings` (module docstring)."""
    owner, code = getattr(fn, "__self__", None), fn.__code__
    material: dict[str, Any] = {"function": [fn.__module__, fn.__qualname__, code.co_filename, code.co_firstlineno],
                                "settings": settings, "sources": source_digest(), "versions": versions()}
    if isinstance(owner, torch.nn.Module):
        material["modules"] = [[name, f"{type(m).__module__}.{type(m).__qualname__}"]
                               for name, m in owner.named_modules()]
        tensors = [*owner.named_parameters(), *owner.named_buffers()]
        material["tensors"] = [[name, list(t.shape), str(t.dtype), str(t.device)] for name, t in tensors]
    return cache_key(material)


def _read_package(found: tuple[dict[str, Any], bytes | None] | None, backend: Any
                  ) -> dynamo_package.PrecompileCacheEntry | None:
    """The stored package with its graphs loaded, or None: none stored, made under other versions or sources, or
    a graph whose entry cannot be loaded."""
    if found is None or found[1] is None:
        return None
    try:
        entry = pickle.loads(found[1])      # verified under the user's key (trace_store)
        entry.dynamo.check_versions()
        for source in entry.dynamo.source_info.inlined_sources:
            module = importlib.import_module(source.module)
            if dynamo_package._hash_sourcelines(module, source.firstlineno, source.lastlineno) != source.checksum:
                return None
    except Exception as exc:                # another torch, a moved module: traced again, and replaced
        log.info("ascend_dsa: a stored trace is not used (%s: %s)", type(exc).__name__, exc)
        return None
    for artifact in entry.backends.values():
        graph = artifact.content if isinstance(artifact, TraceGraph) else None
        if graph is None:
            return None
        graph.compiled = backend.load_traced_graph(graph.key, graph.eager)
        if graph.compiled is None:
            return None
    _numbers_past(found[1])
    return entry


_NUMBERED_GLOBALS = re.compile(rb"(?:__builtins_dict__|__resume_at_\d+|__compiled_fn)_(\d+)")


def _numbers_past(data: bytes) -> None:
    """Move Dynamo's counter of the names it gives the globals it installs past those a loaded package installs:
    they were numbered in another process, and a frame traced here later (a guard of the package failed) would
    otherwise be given one of them again, which Dynamo refuses."""
    numbers = [int(n) for n in _NUMBERED_GLOBALS.findall(data)]
    if numbers:
        current = next(bytecode_transformation._unique_id_counter)
        bytecode_transformation._unique_id_counter = itertools.count(max(current, max(numbers) + 1))


def _lookup(shelf: TraceShelf, key: str, backend: Any
            ) -> tuple[str, dynamo_package.PrecompileCacheEntry | None, bool]:
    """(the key this process's trace lives under, its package when stored and usable, whether torch could not
    install the package kept there: an `unloadable` marker, so nobody stores it again under these versions)."""
    found = shelf.read(key)
    if found is not None and found[1] is None and found[0].get("per_rank"):
        key = trace_watch.rank_key(key)
        found = shelf.read(key)
    unloadable = found is not None and found[1] is None and bool(found[0].get("unloadable"))
    return key, _read_package(found, backend), unloadable


def open_trace(fn: Callable[..., Any], backend: Any, package: Any) -> dynamo_package.PrecompileCacheEntry | None:
    """The package to install for `fn` compiled by `backend`, or None: this process traces it (and, holding its
    lease or with nobody else making it, will store it)."""
    shelf = TraceShelf(backend.cache.disk)
    base = trace_key(fn, backend.config.key())
    key, entry, unloadable = _lookup(shelf, base, backend)
    if entry is not None:
        _install_or_refuse(package, f"{fn.__module__}.{fn.__qualname__}", shelf, key)
        return entry
    if unloadable:          # traced here, as without a warm cache, and not stored again
        return None
    lease = None
    if key == base and shelf.disk.read_only is None and not making(key):
        try:
            lease = shelf.lease(key)
        except OSError as exc:
            shelf.disk.cannot_write(exc)
        if lease is None:       # stored, given up or timed out meanwhile
            key, entry, unloadable = _lookup(shelf, base, backend)
            if entry is not None or unloadable:
                return entry
    if shelf.disk.read_only is None:
        with STATE.lock:
            STATE.pending[id(package)] = Pending(shelf, key, lease, f"{fn.__module__}.{fn.__qualname__}")
        trace_pending.settle_in_background()
    return None


class TraceNotLoadedWarning(UserWarning):
    """torch could not install a kept trace (a guard it cannot rebuild in a new process): the function is traced,
    and the trace is marked `unloadable` in the cache so that later processes trace at once, without the warning."""


def _install_or_refuse(package: Any, function: str, shelf: TraceShelf, key: str) -> None:
    """Make torch's install of a kept package fail the way torch recovers from (a RuntimeError: torch then traces
    the function as usual), with one warning, whatever torch raises rebuilding its guards; the package's place
    under `key` then holds an `unloadable` marker (the key carries torch's version and the traced sources, so a
    new torch or changed code tries again)."""
    if package is None:
        return
    install = type(package).install

    def checked_install(backends: Any) -> None:
        try:
            install(package, backends)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"ascend_dsa: the Dynamo trace of {function} kept in the compile cache cannot be loaded by "
                          f"torch ({reason}); it is traced as without a warm cache, and marked so that later "
                          "processes do not try it again", TraceNotLoadedWarning, stacklevel=2)
            shelf.write(key, None, {"unloadable": reason[:500], "function": function})
            package._initialized = False    # torch initializes it again, empty, and traces
            raise RuntimeError(f"kept trace of {function} not loaded") from exc
        finally:
            del package.install

    package.install = checked_install


def settle(timeout: float = 60.0) -> None:
    """Wait until the traces this process made for the others are stored (or given up)."""
    trace_pending.settle(timeout)


def graph_not_shared() -> None:
    """The backend got a graph that only this process can load (rewritten to be rank-free): the trace holding it
    is not stored, and whoever waits for it traces at once."""
    trace_pending.graph_not_shared()


class TraceStore(dynamo_package.DiskDynamoCache):
    """torch's package store, serving functions compiled with ascend_dsa from the compile cache (module
    docstring); `backend_for(callback)` is the ascend_dsa Backend a torch.compile callback compiles with, or None."""

    def __init__(self, backend_for: Callable[[Any], Any]):
        super().__init__(dynamo_package.DynamoCache.path_prefix())
        self._backend_for = backend_for

    def load(self, fn: Callable[..., Any]) -> dynamo_package.PrecompileCacheEntry | None:
        context = sys._getframe(1).f_locals.get("self")     # torch.compile's context, wrapping `fn`
        callback = getattr(context, "callback", None)
        backend = self._backend_for(callback)
        if backend is None:     # another backend's function: torch's own store, as without ascend_dsa
            return super().load(fn) if callback is not None else None
        if not shareable(backend):
            return None
        _activate()
        trace_watch.watch_compiles(trace_pending.compile_started, trace_pending.compile_ended)
        return open_trace(fn, backend, getattr(context, "_package", None))

    def record_package(self, package: Any) -> None:
        if not trace_pending.recorded(package):     # not ours to store: torch records it for save_cache_artifacts
            super().record_package(package)


def shareable(backend: Any) -> bool:
    """Whether graphs of `backend` can come from a shared trace: its cache is usable, and it neither dumps nor
    verifies graphs (both need Dynamo's graph in hand)."""
    disk, config = backend.cache.disk, backend.config
    return (disk is not None and not disk.refused and disk.key is not None and not config.verify.enabled
            and not config.debug.graph_dump.path)


class _DroppedGuards(logging.Filter):
    """Drops Dynamo's warning per guard on a global that a package does not keep (one per module attribute
    traced: dozens per model), which caching precompile gives by design."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is dropped with caching_precompile" not in record.getMessage()


def install(backend_for: Callable[[Any], Any]) -> None:
    """Serve torch's caching precompile from the compile cache for functions compiled with ascend_dsa (TraceStore
    takes the place of torch's store, which it stays for other backends' functions), unless ASCEND_DSA_SHARE_TRACES
    is 0; switch caching precompile on for the whole process where sharing_requested(). Once, as the backend is
    loaded: torch's switch (TORCH_CACHING_PRECOMPILE=1, torch._dynamo.config.caching_precompile) works whenever it
    is set before torch.compile."""
    share = sharing_requested()
    if os.environ.get(SHARE_ENV) == "0":
        return
    with STATE.lock:
        if not isinstance(dynamo_package.DynamoCache, TraceStore):
            dynamo_package.DynamoCache = TraceStore(backend_for)
    if share:
        torch._dynamo.config.caching_precompile = True


def _activate() -> None:
    """Watch Dynamo for the traces kept from now on (the first time torch.compile wraps a function of ascend_dsa
    under caching precompile); once."""
    with STATE.lock:
        if STATE.installed:
            return
        logging.getLogger("torch._dynamo.guards").addFilter(_DroppedGuards())
        trace_watch.install(trace_pending.met_distributed_now)
        atexit.register(trace_pending.store_all)
        STATE.installed = True

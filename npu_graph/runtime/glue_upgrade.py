"""Inductor's glue compiled in the background while the graph's Python glue serves the first calls.

Compiling the glue of a graph with Inductor (npu_graph.runtime.inductor_glue) costs seconds of Python codegen and
C++ builds per graph (~35 s of a tiny DeepSeek-V3.2's first generate() on 2 cores, against ~25 s for everything
else). Under cpu.glue="auto" the CPU lowering therefore hands back the graph's Python form at once, with a
GlueUpgrade. At the graph's second call (START_AFTER_CALLS: a graph called once never pays for a compile, and
Dynamo has finished with the frame by then) the graph is pickled and queued for the glue worker process
(npu_graph.runtime.glue_worker), hottest graph first; a daemon thread waits for the reply and runs the module
source, and a later call switches the graph to Inductor's glue (CompiledGraph.__call__) — as Inductor's own async
compile mode (TORCHINDUCTOR_FX_COMPILE_MODE=async+subprocess) runs eager code until its out-of-process compile
lands. `wait_all` starts what has not started and waits for everything (benchmarks, before steady-state timing).

Dynamo installed the frame's guards before the compile, so shape guards the compile adds (Kimi Linear's decode
graph: `s6 + 1 <= 4096`) are checked by the graph itself (npu_graph.runtime.size_guards): Inductor's glue runs
where they hold, the Python glue, valid for every input Dynamo admits, elsewhere; a guard the graph cannot check
keeps the Python glue, and the reason says so. A graph that cannot be pickled or compiled keeps it too. The
worker is killed when the process exits: a compile that has not landed by then is dropped (nothing half-built is
stored). The compile cache stores such a graph at once with its Python glue, and again (replacing it) from the
`on_landed` hooks with the glue that runs once the compile lands.
"""
from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import sympy
import torch.fx

from npu_graph.runtime import glue_worker, inductor_glue, size_guards

# (source, globals, attributes) of the graph with Inductor's glue, as the CPU lowering assembles it
Built = tuple[str, dict[str, Any], dict[str, Any]]


class _Queue:
    """Upgrades waiting for the worker, served by one daemon thread: the graph called most often so far first (a
    decode step's graph before a prefill's, before the first decode step's, which runs once per generate())."""

    def __init__(self) -> None:
        self._waiting: list[tuple[GlueUpgrade, bytes]] = []
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None

    def put(self, upgrade: GlueUpgrade, payload: bytes) -> None:
        with self._ready:
            self._waiting.append((upgrade, payload))
            if self._thread is None or not self._thread.is_alive():    # none yet, or this is a forked process
                self._thread = threading.Thread(target=self._serve, name="ascend-dsa-glue", daemon=True)
                self._thread.start()
            self._ready.notify()

    def _serve(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._waiting)
                job = max(self._waiting, key=lambda item: item[0].calls_before)
                self._waiting.remove(job)
            job[0]._run(job[1])


_QUEUE = _Queue()
START_AFTER_CALLS = 1      # calls a graph's Python glue serves before its compile starts (CompiledGraph)
_PENDING: weakref.WeakSet[GlueUpgrade] = weakref.WeakSet()


def wait_all(timeout: float | None = None) -> bool:
    """Start every background glue compile not started yet (graphs called once so far) and wait until all have
    finished; each graph switches at its next call. True when all did within `timeout` seconds. Benchmarks call
    it before they time steady-state runs."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for upgrade in list(_PENDING):
        if not upgrade.started:
            upgrade.start()
    for upgrade in list(_PENDING):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not upgrade._done.wait(left):
            return False
    return True


class GlueUpgrade:
    """One graph's background Inductor compile: `start` it, poll `finished`, then read `ready` (what the graph's
    `prepare` gave for the assembled source: the worker's thread runs it; None when the Python glue stays) and
    `reason`."""

    def __init__(self, gm: torch.fx.GraphModule, assemble: Callable[[str], Built], reason: str) -> None:
        self._gm: torch.fx.GraphModule | None = gm
        self._assemble = assemble
        self.reason = reason                 # why "auto" wanted Inductor's glue; after the compile, what happened
        self.ready: Any = None
        self.calls_before = 0                # calls the Python glue served so far (and before the switch)
        self.prepare: Callable[[Built], Any] = lambda built: built    # the graph's (CompiledGraph.attach_upgrade)
        self.started = False
        self.guards: list[str] = []          # shape guards Inductor's code needs beyond Dynamo's (size_guards)
        self.guard: Callable[[list[Any]], bool] | None = None
        self._sources: dict[str, list[Any]] = {}
        self.on_landed: list[Callable[[GlueUpgrade], None]] = []     # run on the worker's thread (the cache's store)
        self._done = threading.Event()
        _PENDING.add(self)                   # complete before wait_all can see it
        glue_worker.WORKER.warm()            # its start overlaps the rest of the first call

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def start(self) -> None:
        """Pickle the graph here (the pickler patches pytree process-wide, so not beside a Dynamo trace on another
        thread) and queue it for the worker."""
        gm, self._gm, self.started = self._gm, None, True
        self._sources = size_guards.symbol_sources(inductor_glue.traced_inputs(gm))
        try:
            payload = glue_worker.pickled_graph(gm)
        except Exception as exc:
            self._finish(None, f"the graph cannot be sent to the glue worker ({type(exc).__name__}: {exc})")
            return
        _QUEUE.put(self, payload)

    def wait(self, timeout: float | None = None) -> bool:
        """Start the compile if it has not started and wait for it; True when it finished."""
        if not self.started:
            self.start()
        return self._done.wait(timeout)

    def _run(self, payload: bytes) -> None:
        try:
            ready, note = self._compiled(payload)
        except Exception as exc:     # the Python glue runs any graph; the reason is reported
            ready, note = None, f"the background compile failed ({type(exc).__name__}: {exc})"
        self._finish(ready, note)

    def _compiled(self, payload: bytes) -> tuple[Any, str]:
        reply = glue_worker.WORKER.compile(payload)
        if "error" in reply:
            return None, f"Inductor could not take the graph ({reply['error']})"
        note = "compiled in the background while the Python glue ran the first calls"
        if reply["guards"]:
            try:
                self.guard = size_guards.guard_check(reply["guards"], self._sources)
            except (ValueError, TypeError, sympy.SympifyError) as exc:
                return None, (f"Inductor's compile added shape guards ({', '.join(reply['guards'])}) that Dynamo no "
                              f"longer checks and this graph cannot check ({exc}): the Python glue stays")
            self.guards = list(reply["guards"])
            note += f"; it runs where its shape guards ({', '.join(self.guards)}) hold, the Python glue elsewhere"
        return self.prepare(self._assemble(reply["source"])), note

    def _finish(self, ready: Any, note: str) -> None:
        self.ready = ready
        self.reason = f"{self.reason}; {note}"
        try:
            for listener in self.on_landed:
                listener(self)
        except Exception as exc:     # the graph still switches; the store is only lost
            warnings.warn(f"ascend_dsa: after a background glue compile: {type(exc).__name__}: {exc}", stacklevel=1)
        finally:
            self._done.set()

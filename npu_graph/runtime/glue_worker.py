"""The process that compiles Inductor glue in the background (npu_graph.runtime.glue_upgrade).

Inductor's compile cannot share a process with Dynamo tracing another frame: AOT autograd and the FX tracer patch
process-wide state while they trace (torch.nn.Module's attribute lookup among it), and a Dynamo compile running
at the same time builds guards from what it sees then. So the glue is compiled in a child process, as Inductor's
own out-of-process compile does (torch._inductor.compile_fx_subproc): the parent pickles the graph with its
fake tensors and ShapeEnv (torch.fx._graph_pickler, the fused ops allowed), the child — `python -m
npu_graph.runtime.glue_worker`, which imports npu_graph and so registers the fused ops — compiles it with
npu_graph.runtime.inductor_glue.compile_forward and sends back the module source and the shape guards the
compile added. One child serves the process, one graph at a time, at a lower priority (NICENESS); it is started
at the first request and killed when the parent exits. Messages are 8-byte lengths and pickles on the child's
stdin and on a copy of its stdout (its own stdout goes to stderr, so nothing it prints can break a message).
"""
from __future__ import annotations

import atexit
import os
import pickle
import struct
import subprocess
import sys
import threading
from typing import Any, BinaryIO

_LENGTH = struct.Struct("<Q")
# The worker and its compilers run below the user's own work: on a 2-core machine a first generate() shares the CPU
# with them
NICENESS = 10


def _send(stream: BinaryIO, data: bytes) -> None:
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> bytes | None:
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (size,) = _LENGTH.unpack(header)
    return stream.read(size)


def pickled_graph(gm: Any) -> bytes:
    """gm with its fake inputs' metadata and ShapeEnv, as the child unpickles it."""
    from torch.fx._graph_pickler import GraphPickler, Options

    return GraphPickler.dumps(gm, Options(ops_filter=None))


class GlueWorker:
    """The parent's handle on the child: `compile(payload)` blocks until the child replies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._pid = os.getpid()
        self._exiting = False      # set at the owner's exit: a compile still queued then starts no new child

    def _started(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None or self._pid != os.getpid():
            self._pid = os.getpid()        # a forked process starts a worker of its own: the pipes are its parent's
            # the parent's import path: npu_graph (and what a script put on sys.path) imports as it does here
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            self._process = subprocess.Popen([sys.executable, "-m", "npu_graph.runtime.glue_worker"],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            atexit.register(self._stop, self._process, self._pid)
        return self._process

    def _stop(self, process: subprocess.Popen, owner: int) -> None:
        """Kill the child (a compile that has not landed is dropped) and close its pipes; in the process that
        started it only (a forked copy exiting leaves its parent's worker alone). Later requests get an error
        instead of a new child: a graph's compile thread still waiting for the worker would otherwise start one
        that outlives this process."""
        if os.getpid() != owner:
            return
        self._exiting = True
        process.kill()
        process.wait()
        process.stdin.close()
        process.stdout.close()

    def warm(self) -> None:
        """Start the child now (it imports torch, npu_graph and Inductor: seconds) so it is ready by the first
        request."""
        with self._lock:
            self._started()

    def compile(self, payload: bytes) -> dict[str, Any]:
        """{"source": ..., "guards": [...]} or {"error": ...}."""
        with self._lock:
            if self._exiting and self._pid == os.getpid():
                return {"error": "the process is exiting"}
            process = self._started()
            try:
                _send(process.stdin, payload)
                reply = _receive(process.stdout)
            except OSError as exc:
                reply, failure = None, f"{type(exc).__name__}: {exc}"
            else:
                failure = ""
            if reply is None:
                code = process.poll()
                return {"error": f"the glue worker stopped ({failure or f'exit code {code}'})"}
            return pickle.loads(reply)


WORKER = GlueWorker()


def _compile_in_child(payload: bytes) -> dict[str, Any]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from npu_graph.runtime import inductor_glue

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    gm = GraphPickler.loads(payload, fake_mode)
    shape_env = fake_mode.shape_env
    before = len(shape_env.guards)
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
        source = inductor_glue.compile_forward(gm)
    return {"source": source, "guards": [str(g.expr) for g in shape_env.guards[before:]]}


def main() -> None:
    if hasattr(os, "nice"):      # POSIX; elsewhere the worker runs at the parent's priority
        os.nice(NICENESS)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    import torch._inductor.compile_fx  # noqa: F401  (imported while the parent has nothing to send yet)

    import npu_graph  # noqa: F401  (registers the fused ops the graphs call)

    requests = sys.stdin.buffer
    while (payload := _receive(requests)) is not None:
        try:
            reply = _compile_in_child(payload)
        except Exception as exc:      # the parent keeps the Python glue and reports why
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            _send(replies, pickle.dumps(reply))
        except BrokenPipeError:     # the parent is gone (it stops this process at its exit): nothing to tell
            return


if __name__ == "__main__":
    main()

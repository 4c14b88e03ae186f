"""One rank of a launched run: its spawned process, in a session of its own, and the pipe it reports on.

In the child, `_rank_main` first makes the rank a session leader, so that the rank and the processes it
starts form one process group that `RankProcess.kill` ends at once. It then says it has started (fn's module
is imported, fn and args are unpickled), joins the torch.distributed process group, runs fn, flushes its
output and reports either the result (`torch.save` bytes) or its traceback. In the parent, `RankProcess`
reads those reports without blocking and says how a rank that ended without one died.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

_STARTED = "started"


@dataclass(frozen=True)
class RunSpec:
    """What every rank of one run is given."""
    fn: Callable[..., Any]
    args: tuple
    world_size: int
    init_method: str
    backend: str
    timeout_s: float


class Report(NamedTuple):
    """What a rank sends once fn has returned or raised."""
    ok: bool
    payload: Any        # the result as torch.save bytes, or the traceback
    at: float           # time.monotonic() when it was made: one clock for every process of the machine


def _flush_output() -> None:
    """Flush what fn printed: the parent kills the rank as soon as every rank has reported."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):     # a closed or broken stream
                stream.flush()


def _rank_main(spec: RunSpec, rank: int, channel: Connection) -> None:
    os.setsid()
    channel.send(_STARTED)
    try:
        dist.init_process_group(spec.backend, init_method=spec.init_method, rank=rank,
                                world_size=spec.world_size, timeout=timedelta(seconds=spec.timeout_s))
        buffer = io.BytesIO()
        torch.save(spec.fn(*spec.args), buffer)
        report = Report(True, buffer.getvalue(), time.monotonic())
    except BaseException:
        report = Report(False, traceback.format_exc(), time.monotonic())
    _flush_output()
    try:
        channel.send(report)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass
class RankProcess:
    """A started rank: its process, the parent's end of its report pipe, and what it has reported."""
    index: int
    process: BaseProcess
    reader: Connection
    started: bool = False
    report: Report | None = None

    @classmethod
    def start(cls, context: SpawnContext, spec: RunSpec, index: int) -> RankProcess:
        """Spawn rank `index`. fn and args are pickled here, before the process exists: when they cannot
        be, ValueError says so and no process is left."""
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(target=_rank_main, args=(spec, index, writer), name=f"rank {index}",
                                  daemon=True)
        try:
            process.start()
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            reader.close()
            raise ValueError(
                f"launch: fn and args must be pickled to reach the ranks, which are fresh 'spawn' processes, "
                f"but {type(error).__name__}: {error}. Define fn at module level in an importable module "
                f"(not a lambda or a local function) and pass picklable args") from error
        finally:
            writer.close()      # the child holds its own copy
        return cls(index, process, reader)

    @property
    def failure(self) -> str | None:
        """The traceback the rank reported, if it raised."""
        return self.report.payload if self.report is not None and not self.report.ok else None

    def receive(self) -> None:
        """Read what the rank has sent so far; never waits for a message that has not begun to arrive."""
        while self.report is None and self.reader.poll():
            try:
                message = self.reader.recv()
            except (EOFError, OSError):     # the pipe closed, perhaps mid-message: the rank is gone
                return
            if message == _STARTED:
                self.started = True
            else:
                self.report = message

    def exited(self) -> bool:
        """Whether the process has exited (this reaps it, so its group must be killed soon after)."""
        return self.process.exitcode is not None

    def died(self) -> bool:
        """Whether the process exited without reporting (everything it sent before exiting is read first)."""
        if not self.exited():
            return False
        self.receive()
        return self.report is None

    def death(self) -> str:
        """How the rank died, e.g. 'rank 1 died (exit code 0) before reporting a result'."""
        code = self.process.exitcode
        how = f"killed by {_signal_name(-code)}" if code < 0 else f"exit code {code}"
        if self.started:
            return f"rank {self.index} died ({how}) before reporting a result"
        return (f"rank {self.index} died ({how}) while starting up, before fn ran: the fresh process could not "
                f"import fn's module or unpickle fn and args (its traceback, if any, is on stderr)")

    def kill(self) -> None:
        """Kill the rank, then its process group (what it started and did not move to a session of its
        own), then reap it. The rank dies first, so it cannot start anything after the group is killed."""
        self.process.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):   # no process left in the group
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.join()
        self.reader.close()

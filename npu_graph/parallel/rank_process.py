"""One rank of a launched run, as torch.distributed.elastic starts it, and what it leaves in the run's folder.

`rank_main` is the function the elastic agent runs in each worker process (its errors recorded in the agent's
error file by `torch.distributed.elastic.multiprocessing.errors.record`). It first makes the rank a session
leader, so that the rank and the processes it starts form one process group the launcher ends at once, sends
faulthandler's stacks of a crash to a file of the run's folder and writes its pid; then it unpickles fn and args
(importing fn's module), says it has started, joins the process group the agent's environment describes
(env://, the agent's store), runs fn, flushes its output and returns the result as `torch.save` bytes. Whatever
fn raises (SystemExit too) is written with its traceback and the time, then raised.

`RunFolder` reads those files on the launcher's side; `ExitWatch` notes how and when each rank process ended
(`waitid` with WNOWAIT, which leaves the process to the agent to reap).
"""
from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


class RankFailure(RuntimeError):
    """fn raised in a rank (its traceback is the message), or the rank could not start fn."""


def _write(path: Path, text: str) -> None:
    """Write `text` to `path` whole (a temporary file renamed into place)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def _flush_output() -> None:
    """Flush what fn printed: the launcher kills the rank's process group once the run has ended."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):     # a closed or broken stream
                stream.flush()


def _failed(folder: Path, rank: int, stage: str) -> RankFailure:
    """Write the exception being handled (its traceback, the time, `stage`: "start" or "run") for the launcher."""
    text = traceback.format_exc()
    _write(folder / f"rank{rank}.failed", json.dumps({"at": time.time(), "stage": stage, "traceback": text}))
    return RankFailure(text)


@record
def rank_main(payload: bytes, run_dir: str, backend: str, timeout_s: float) -> bytes:
    """Run one rank (module docstring): `payload` is pickle.dumps((fn, args))."""
    os.setsid()
    folder, rank = Path(run_dir), int(os.environ["RANK"])
    crash_file = open(folder / f"rank{rank}.crash", "w")   # noqa: SIM115 (open while the process lives)
    faulthandler.enable(crash_file, all_threads=True)
    _write(folder / f"rank{rank}.pid", str(os.getpid()))
    try:
        fn, args = pickle.loads(payload)
    except BaseException as error:
        raise _failed(folder, rank, "start") from error
    _write(folder / f"rank{rank}.started", "")
    try:
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)
    except BaseException as error:      # the process group is left as it is: tearing it down could wait on peers
        _flush_output()
        raise _failed(folder, rank, "run") from error
    dist.destroy_process_group()
    _flush_output()
    _write(folder / f"rank{rank}.done", "")
    return buffer.getvalue()


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class Exit:
    """How a rank process ended: `code` is its exit status, or minus the signal that killed it."""
    code: int
    at: float           # time.time() when it was seen

    def how(self) -> str:
        return f"killed by {signal_name(-self.code)}" if self.code < 0 else f"exit code {self.code}"


class ExitWatch:
    """A thread per rank process that waits for its end without reaping it (the agent reaps it)."""

    def __init__(self) -> None:
        self.exits: dict[int, Exit] = {}
        self._watched: set[int] = set()

    def watch(self, rank: int, pid: int) -> None:
        if rank not in self._watched:
            self._watched.add(rank)
            threading.Thread(target=self._wait, args=(rank, pid), name=f"rank {rank} exit", daemon=True).start()

    def _wait(self, rank: int, pid: int) -> None:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:       # reaped already (the agent was first): how it ended is not known
            return
        if info is not None:
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            self.exits[rank] = Exit(code, time.time())


class RunFolder:
    """The files the ranks of one run write (rank_main), read by the launcher."""

    def __init__(self, path: str, world_size: int) -> None:
        self.path, self.world_size = Path(path), world_size

    def _file(self, rank: int, what: str) -> Path:
        return self.path / f"rank{rank}.{what}"

    def pids(self) -> dict[int, int]:
        """The pid of each rank that has written it (a session leader from then on)."""
        found = {}
        for rank in range(self.world_size):
            with contextlib.suppress(OSError, ValueError):
                found[rank] = int(self._file(rank, "pid").read_text())
        return found

    def crash_report(self, rank: int) -> str:
        """The Python stacks faulthandler wrote when the rank crashed (a segmentation fault), else ""."""
        try:
            return self._file(rank, "crash").read_text(errors="replace").strip()
        except OSError:
            return ""

    def started(self, rank: int) -> bool:
        return self._file(rank, "started").exists()

    def done(self, rank: int) -> bool:
        return self._file(rank, "done").exists()

    def failure(self, rank: int) -> dict[str, Any] | None:
        """{"at", "stage", "traceback"} when the rank raised, else None."""
        try:
            return json.loads(self._file(rank, "failed").read_text())
        except (OSError, ValueError):
            return None

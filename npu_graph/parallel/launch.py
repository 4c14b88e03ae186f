"""Spawn a distributed run on one machine and collect every rank's result, failing fast and clearly.

`launch(fn, world_size)` starts `world_size` fresh processes ('spawn'), joins them into one
`torch.distributed` process group (gloo on CPU; HCCL where torch_npu is present) through a file store in a
private temporary folder (no port to race for), calls `fn(*args)` in each and returns the results in rank
order. Results travel back as `torch.save` bytes, so they may hold tensors.

No hang: the parent never waits without a deadline. It fails with `DistributedLaunchError` naming the rank
as soon as one raises (its traceback included) or ends without reporting a result (`os._exit`, even with
status 0, a crash, a kill), and after `timeout_s` seconds in all, counting start-up. A survivor's collective
often fails first, on the connection the dead rank dropped: the dead rank is then named as the cause.
The same `timeout_s` is the process group's own collective timeout, so a rank left alone also gives up.

No process left behind: each rank leads a session of its own (rank_process.py), and when the run ends,
however it ends, every rank is killed together with its process group: the processes it started, unless
one moved itself to a group of its own (`start_new_session=True`, `os.setsid`).
A function or argument that cannot be pickled is refused before any rank starts.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing import connection
from typing import Any

import torch

from npu_graph.parallel.rank_process import RankProcess, RunSpec

# Longest wait between checks. A rank's exit is also polled for because a process it forked may hold its
# exit sentinel and report pipe open after it died.
_POLL_S = 0.1
_GRACE_S = 0.5     # after a rank's exception, time for a peer's death (its likely cause) to show


class DistributedLaunchError(RuntimeError):
    """A rank of a launched run failed, died, or the run went past its timeout."""


def default_backend() -> str:
    """"hccl" when torch_npu provides Ascend devices, else "gloo"."""
    npu = getattr(torch, "npu", None)
    return "hccl" if npu is not None and npu.is_available() else "gloo"


def _check_importable(fn: Callable[..., Any]) -> None:
    """A function of a __main__ without a file pickles, but no spawned process can import it back."""
    if getattr(fn, "__module__", None) == "__main__" and not getattr(sys.modules["__main__"], "__file__", None):
        name = getattr(fn, "__qualname__", repr(fn))
        raise ValueError(f"launch: {name} is defined in an interactive __main__ (no file), which the ranks, "
                         f"fresh 'spawn' processes, cannot import: define fn in a module file and import it")


def _wait_any_exit(ranks: list[RankProcess], seconds: float) -> None:
    """Wait up to `seconds` until one of `ranks` has exited."""
    deadline = time.monotonic() + seconds
    while ranks and not any(rank.exited() for rank in ranks):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        connection.wait([rank.process.sentinel for rank in ranks], min(left, _POLL_S))


def _first_failed(ranks: list[RankProcess]) -> RankProcess | None:
    """The rank that raised first (reports from several ranks can arrive together)."""
    failed = [rank for rank in ranks if rank.failure is not None]
    return min(failed, key=lambda rank: rank.report.at) if failed else None


def _death_error(dead: RankProcess, ranks: list[RankProcess]) -> DistributedLaunchError:
    text = f"{dead.death()}; the other ranks were stopped"
    failed = _first_failed(ranks)
    if failed is not None:
        text += f"\nrank {failed.index} then failed:\n{failed.failure}"
    return DistributedLaunchError(text)


def _failure_error(failed: RankProcess, ranks: list[RankProcess]) -> DistributedLaunchError:
    """A rank's exception, unless a peer died meanwhile: that death is then the likely cause."""
    others = [rank for rank in ranks if rank.report is None]
    _wait_any_exit(others, _GRACE_S)
    dead = [rank for rank in others if rank.died()]
    if dead:
        return _death_error(dead[0], ranks)
    return DistributedLaunchError(f"rank {failed.index} raised an exception; the other ranks were stopped:\n"
                                  f"{failed.failure}")


def _timeout_error(waiting: list[RankProcess], timeout_s: float) -> DistributedLaunchError:
    text = (f"distributed run timed out after {timeout_s:g} s: ranks {[rank.index for rank in waiting]} "
            f"did not finish")
    starting = [rank.index for rank in waiting if not rank.started]
    if starting:
        text += f" (ranks {starting} were still starting up)"
    return DistributedLaunchError(text + "; raise timeout_s if the work needs longer")


def _collect(ranks: list[RankProcess], deadline: float, timeout_s: float) -> list[Any]:
    while waiting := [rank for rank in ranks if rank.report is None]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timeout_error(waiting, timeout_s)
        connection.wait([rank.reader for rank in waiting] + [rank.process.sentinel for rank in waiting],
                        min(remaining, _POLL_S))
        dead = [rank for rank in waiting if rank.died()]
        if dead:
            raise _death_error(dead[0], ranks)
        for rank in waiting:
            rank.receive()
        failed = _first_failed(waiting)
        if failed is not None:
            raise _failure_error(failed, ranks)
    return [torch.load(io.BytesIO(rank.report.payload), weights_only=False) for rank in ranks]


def launch(fn: Callable[..., Any], world_size: int, *, args: tuple = (), timeout_s: float = 120.0,
           backend: str | None = None) -> list[Any]:
    """Run `fn(*args)` on `world_size` spawned ranks of one process group; returns their results by rank.

    `fn` must be importable by name (a module-level function) and `args` picklable; ValueError otherwise.
    Inside fn, `torch.distributed.get_rank()` tells the rank. Raises DistributedLaunchError when a rank
    fails or dies, or after `timeout_s`. When launch returns or raises, no rank is left running, nor any
    process a rank started (unless that process moved itself to a session or process group of its own).
    """
    if world_size < 1:
        raise ValueError(f"launch: world_size must be >= 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"launch: timeout_s must be > 0, got {timeout_s}")
    _check_importable(fn)
    deadline = time.monotonic() + timeout_s
    store_dir = tempfile.mkdtemp(prefix="ascend_dsa_launch_")
    spec = RunSpec(fn, args, world_size, "file://" + os.path.join(store_dir, "store"),
                   backend or default_backend(), timeout_s)
    context = mp.get_context("spawn")
    ranks: list[RankProcess] = []
    try:
        for index in range(world_size):
            ranks.append(RankProcess.start(context, spec, index))
        return _collect(ranks, deadline, timeout_s)
    finally:
        for rank in ranks:
            rank.kill()
        shutil.rmtree(store_dir, ignore_errors=True)

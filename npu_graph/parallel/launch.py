"""Spawn a distributed run on one machine and collect every rank's result, failing fast and clearly.

`launch(fn, world_size)` starts `world_size` fresh processes ('spawn'), joins them into one
`torch.distributed` process group (gloo on CPU; HCCL where torch_npu is present) through a file store in a
private temporary folder (no port to race for), calls `fn(*args)` in each and returns the results in rank
order. Results travel back as `torch.save` bytes, so they may hold tensors.

No hang: the parent never waits without a deadline. It fails with `DistributedLaunchError` naming the rank
as soon as one raises (its traceback included) or exits without reporting (a crash, `os._exit`, a kill), and
after `timeout_s` seconds in all, counting start-up; the survivors, typically blocked in a collective that
waits for the dead rank, are then terminated. The same `timeout_s` is the process group's own collective
timeout, so a rank left alone also gives up by itself.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_POLL_S = 0.1          # how often the parent checks for dead ranks while waiting for results
_JOIN_S = 5.0          # grace period for a terminated rank before it is killed
_GRACE_S = 0.5         # after a rank's exception, time for a peer's death (its likely cause) to show


class DistributedLaunchError(RuntimeError):
    """A rank of a launched run failed, died, or the run went past its timeout."""


def default_backend() -> str:
    """"hccl" when torch_npu provides Ascend devices, else "gloo"."""
    npu = getattr(torch, "npu", None)
    return "hccl" if npu is not None and npu.is_available() else "gloo"


def _worker(fn: Callable[..., Any], args: tuple, rank: int, world_size: int, init_method: str, backend: str,
            timeout_s: float, results: Any) -> None:
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _dead_rank(processes: list[Any], pending: set[int]) -> tuple[int, int] | None:
    """(rank, exit code) of a rank that exited abnormally before reporting, if any."""
    for rank in sorted(pending):
        code = processes[rank].exitcode
        if code not in (None, 0):
            return rank, code
    return None


def _raise_failure(processes: list[Any], pending: set[int], rank: int, trace: str) -> None:
    """Report a rank's exception; when a peer died meanwhile, that death is the cause (a survivor's
    collective often fails first, on the lost connection)."""
    time.sleep(_GRACE_S)
    dead = _dead_rank(processes, pending - {rank})
    if dead is not None:
        raise DistributedLaunchError(f"rank {dead[0]} died (exit code {dead[1]}) before reporting a result; "
                                     f"rank {rank} then failed and the other ranks were stopped:\n{trace}")
    raise DistributedLaunchError(f"rank {rank} raised an exception; the other ranks were stopped:\n{trace}")


def _collect(processes: list[Any], results: Any, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    collected: dict[int, Any] = {}
    pending = set(range(len(processes)))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DistributedLaunchError(f"distributed run timed out after {timeout_s:g} s: ranks {sorted(pending)} "
                                         f"did not finish; raise timeout_s if the work needs longer")
        try:
            rank, ok, payload = results.get(timeout=min(_POLL_S, remaining))
        except queue_module.Empty:
            dead = _dead_rank(processes, pending)
            if dead is not None:
                raise DistributedLaunchError(f"rank {dead[0]} died (exit code {dead[1]}) before reporting a "
                                             f"result; the other ranks were stopped") from None
            continue
        if not ok:
            _raise_failure(processes, pending, rank, payload)
        collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        pending.discard(rank)
    return [collected[rank] for rank in range(len(processes))]


def _stop(processes: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(_JOIN_S)
        if process.is_alive():
            process.kill()
            process.join()


def launch(fn: Callable[..., Any], world_size: int, *, args: tuple = (), timeout_s: float = 120.0,
           backend: str | None = None) -> list[Any]:
    """Run `fn(*args)` on `world_size` spawned ranks of one process group; returns their results by rank.

    `fn` must be importable by name (a module-level function). Inside it, `torch.distributed.get_rank()`
    tells the rank. Raises DistributedLaunchError when a rank fails or dies, or after `timeout_s`.
    """
    if world_size < 1:
        raise ValueError(f"launch: world_size must be >= 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"launch: timeout_s must be > 0, got {timeout_s}")
    context = mp.get_context("spawn")
    results = context.Queue()
    store_dir = tempfile.mkdtemp(prefix="ascend_dsa_launch_")
    init_method = "file://" + os.path.join(store_dir, "store")
    processes = [context.Process(target=_worker, daemon=True,
                                 args=(fn, args, rank, world_size, init_method, backend or default_backend(),
                                       timeout_s, results))
                 for rank in range(world_size)]
    try:
        for process in processes:
            process.start()
        return _collect(processes, results, timeout_s)
    finally:
        _stop(processes)
        results.close()
        shutil.rmtree(store_dir, ignore_errors=True)

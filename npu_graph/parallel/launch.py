"""Run a function on the ranks of one torch.distributed process group on this machine, through
torch.distributed.elastic, and collect every rank's result, failing fast and clearly.

`launch(fn, world_size)` is a thin layer over the elastic launcher API (`LaunchConfig` / `elastic_launch`, the
machinery `torchrun` runs): the elastic agent runs in the calling process, holds a c10d rendezvous on a free
local port, spawns `world_size` workers ('spawn'), gives them the environment `init_process_group("env://")`
reads, and records a failing worker's exception in its error file (`errors.record`). Each worker runs
`rank_process.rank_main`, which joins the group (gloo on CPU; HCCL where torch_npu is present), calls
`fn(*args)` and returns the result as `torch.save` bytes; results come back in rank order.

What this layer adds to the agent:
- The failing rank named with its traceback: a rank that raises (SystemExit too), ends without a result
  (`os._exit`, even with status 0), is killed or crashes (a segmentation fault: the Python stacks faulthandler
  wrote are included) fails the run with `DistributedLaunchError` naming it; a survivor's collective often fails
  first, on the connection the dead rank dropped, and the dead rank is then named as the cause (rank_failures.py).
- A deadline: after `timeout_s` seconds in all, counting start-up, every rank is stopped and the error names the
  ranks that had not finished. The same `timeout_s` is the process group's collective timeout.
- Nothing left running: each rank leads a session of its own, and when the run ends, however it ends, every
  rank's process group is killed: the processes it started, unless one moved itself to a session or group of
  its own (`start_new_session=True`, `os.setsid`).
- A function or argument that cannot be pickled is refused before any rank starts.
The agent's own logging is kept quiet (the error says what happened) and the signal handlers it installs in
the calling process are put back afterwards.

Across machines, start the ranks with `torchrun` instead (README "Distributed").
"""
from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from npu_graph.parallel.rank_failures import DistributedLaunchError, run_error
from npu_graph.parallel.rank_process import ExitWatch, RunFolder, rank_main

_POLL_S = 0.05          # how often the run's folder and the deadline are looked at
_GRACE_S = 0.5          # after a rank ended without a result, time for its peers to fail on their own
_EXIT_S = 5.0           # after a rank raised, time for it to end by itself (the agent then stops its peers)
_SHUTDOWN_S = 1         # the agent's wait between SIGTERM and SIGKILL when it stops the ranks
_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


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


def _pickled(fn: Callable[..., Any], args: tuple) -> bytes:
    try:
        return pickle.dumps((fn, args))
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        raise ValueError(
            f"launch: fn and args must be pickled to reach the ranks, which are fresh 'spawn' processes, "
            f"but {type(error).__name__}: {error}. Define fn at module level in an importable module "
            f"(not a lambda or a local function) and pass picklable args") from error


class _Run:
    """One launch's folder and its monitor thread: it watches each rank's end, stops every rank at the deadline
    or shortly after one ended without a result, and kills every rank's process group at the end."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.folder = RunFolder(tempfile.mkdtemp(prefix="ascend_dsa_launch_"), world_size)
        self.timeout_s, self.deadline = timeout_s, time.monotonic() + timeout_s
        self.watch, self.timed_out = ExitWatch(), False
        self.stopped_at: float | None = None     # time.time() when this launcher stopped the ranks
        self._before = set(multiprocessing.active_children())
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._run, name="ascend-dsa launch monitor", daemon=True)

    def __enter__(self) -> _Run:
        self._monitor.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._monitor.join()
        self.kill_all()
        shutil.rmtree(self.folder.path, ignore_errors=True)

    def _run(self) -> None:
        stop_at = None
        while not self._stop.wait(_POLL_S):
            for rank, pid in self.folder.pids().items():
                self.watch.watch(rank, pid)
            grace = self._grace()
            if grace is not None:       # its peers may wait for it, or it may not end by itself
                stop_at = min(stop_at or float("inf"), time.monotonic() + grace)
            if time.monotonic() >= self.deadline:
                self.timed_out = True
            if self.timed_out or (stop_at is not None and time.monotonic() >= stop_at):
                self.stopped_at = self.stopped_at or time.time()
                self.kill_all()

    def _grace(self) -> float | None:
        """How long to wait before stopping every rank: a rank ended without a result (_GRACE_S), or raised
        (_EXIT_S: its own exit, with its exit status, normally comes first); None while no rank failed."""
        if any(not self.folder.done(rank) for rank in self.watch.exits):
            return _GRACE_S
        if any(self.folder.failure(rank) is not None for rank in range(self.folder.world_size)):
            return _EXIT_S
        return None

    def kill_all(self) -> None:
        """SIGKILL every rank's process group, and every worker that has not yet become a session leader."""
        for pid in self.folder.pids().values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for child in set(multiprocessing.active_children()) - self._before:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child.pid, signal.SIGKILL)


@contextlib.contextmanager
def _agent_in_this_process() -> Iterator[None]:
    """Keep the elastic agent's logging quiet and put back the signal handlers and the environment variable it
    sets in this process."""
    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"))]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    main = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in _SIGNALS.split(","))} if main else {}
    environment = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if environment is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = environment


def _config(world_size: int, folder: str, timeout_s: float) -> LaunchConfig:
    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=f"ascend-dsa-{uuid.uuid4().hex}",
                        role="rank", rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                        rdzv_configs={"is_host": True, "timeout": max(int(timeout_s), 1)}, max_restarts=0,
                        monitor_interval=_POLL_S, start_method="spawn", shutdown_timeout=_SHUTDOWN_S,
                        local_addr="127.0.0.1", signals_to_handle=_SIGNALS,
                        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(folder, "logs")))


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
    payload = _pickled(fn, args)
    with _Run(world_size, timeout_s) as run, _agent_in_this_process():
        config = _config(world_size, str(run.folder.path), timeout_s)
        try:
            results = elastic_launch(config, rank_main)(payload, str(run.folder.path), backend or default_backend(),
                                                       timeout_s)
        except ChildFailedError as error:
            raise run_error(run, error.failures) from None
        except Exception as error:
            raise DistributedLaunchError(f"the elastic agent could not run the ranks: {type(error).__name__}: "
                                         f"{error}") from error
    return [torch.load(io.BytesIO(results[rank]), weights_only=False) for rank in range(world_size)]

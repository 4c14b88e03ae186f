"""Per-entry cache locks: an exclusive flock on `locks/<key>.lock` holding the holder's pid, and the bounded wait
(ASCEND_DSA_CACHE_LOCK_TIMEOUT seconds, 600 by default) of a process that finds it held."""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
import warnings

from npu_graph.observe import progress

LOCK_TIMEOUT_ENV = "ASCEND_DSA_CACHE_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT_S = 600.0
_LOCK_POLL_S = 0.1


class CacheWarning(UserWarning):
    """The cache refused or repaired something; compilation goes on without it."""


def _try_flock(fd: int) -> bool:
    """Take the exclusive flock without blocking; False while another process holds it. A file system without
    flock counts as taken (renames still keep entries whole)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        pass
    return True


def _lock_holder(fd: int) -> str:
    """The pid the lock's holder wrote into the lock file, as text."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return text if text.isdigit() else "(pid unknown)"


def lock_timeout_from_env() -> float:
    """Seconds to wait for another process's entry lock: ASCEND_DSA_CACHE_LOCK_TIMEOUT, else 600."""
    text = os.environ.get(LOCK_TIMEOUT_ENV, "")
    try:
        return float(text) if text else DEFAULT_LOCK_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{LOCK_TIMEOUT_ENV}={text!r} is not a number of seconds") from None


def _wait_for_lock(fd: int, key: str, timeout: float) -> bool:
    """Poll the lock until it is ours (True) or `timeout` passes (False, one warning naming the holder); a status
    line on stderr says whom this process waits for."""
    with progress.step(f"waiting for process {_lock_holder(fd)}, which is compiling the same graph "
                         f"(cache entry {key[:12]})"):
        deadline = time.monotonic() + timeout
        while not _try_flock(fd):
            if time.monotonic() >= deadline:
                warnings.warn(f"ascend_dsa cache: waited {timeout:g} s for the lock of entry {key[:12]}, held by "
                              f"process {_lock_holder(fd)}; compiling this graph without waiting for it (set "
                              f"{LOCK_TIMEOUT_ENV} to wait longer)", CacheWarning, stacklevel=3)
                return False
            time.sleep(_LOCK_POLL_S)
    return True


def take_entry_lock(path: str, key: str, timeout: float) -> int | None:
    """The entry's lock file at `path`, flocked, with this process's pid written in it for the processes that
    wait; None when another process held it past `timeout`."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if not _try_flock(fd) and not _wait_for_lock(fd, key, timeout):
            os.close(fd)
            return None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd

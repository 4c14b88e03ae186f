"""One compiler per cache entry across processes and hosts: take the entry's lease (npu_graph.cache.lease), or wait
for its holder, sleeping between looks, until the entry is stored, the lease is free or stale, or
ASCEND_DSA_CACHE_LOCK_TIMEOUT seconds (600) pass. The native kernels' builds share the same wait (`Work` says what
the lease is held for). A lease is stale when its heartbeat has not changed for
ASCEND_DSA_CACHE_LEASE_STALE seconds (20; its holder renews it 5 times in that span), or at once when its holder
was a process of this machine that has ended."""
from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from npu_graph.cache.lease import Holder, Lease, break_lease, read_holder, try_take
from npu_graph.observe import progress

LOCK_TIMEOUT_ENV = "ASCEND_DSA_CACHE_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT_S = 600.0
LEASE_STALE_ENV = "ASCEND_DSA_CACHE_LEASE_STALE"
DEFAULT_LEASE_STALE_S = 20.0
_FIRST_LOOK_S, _LONGEST_SLEEP_S = 0.02, 0.5     # a waiter's sleeps between looks grow from one to the other


class CacheWarning(UserWarning):
    """The cache refused or repaired something; compilation goes on without it."""


@dataclass(frozen=True)
class Work:
    """What a lease is held for, as a waiting process's status line and timeout warning name it."""
    doing: str          # "compiling the same graph (cache entry 0123456789ab)"
    lock: str           # "the lock of entry 0123456789ab"
    instead: str        # what the waiter does after its timeout


def entry_work(key: str) -> Work:
    return Work(f"compiling the same graph (cache entry {key[:12]})", f"the lock of entry {key[:12]}",
                f"compiling this graph without waiting for it (set {LOCK_TIMEOUT_ENV} to wait longer)")


def _seconds_from_env(name: str, default: float) -> float:
    text = os.environ.get(name, "")
    try:
        value = float(text) if text else default
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={text!r} must be a positive number of seconds")
    return value


def lock_timeout_from_env() -> float:
    """Seconds to wait for another process's entry: ASCEND_DSA_CACHE_LOCK_TIMEOUT, else 600."""
    return _seconds_from_env(LOCK_TIMEOUT_ENV, DEFAULT_LOCK_TIMEOUT_S)


def lease_stale_from_env() -> float:
    """Seconds without a heartbeat after which a lease is stale: ASCEND_DSA_CACHE_LEASE_STALE, else 20."""
    return _seconds_from_env(LEASE_STALE_ENV, DEFAULT_LEASE_STALE_S)


class _Watch:
    """What a waiter has seen of a lease: its content, and since when (this process's clock) it is unchanged."""

    def __init__(self) -> None:
        self.seen: bytes | None = None
        self.since = time.monotonic()

    def stale(self, holder: Holder, stale_s: float) -> bool:
        now = time.monotonic()
        if holder.raw != self.seen:
            self.seen, self.since = holder.raw, now
        return holder.gone() or now - self.since >= stale_s


def _timed_out(work: Work, timeout: float, holder: Holder) -> None:
    warnings.warn(f"ascend_dsa cache: waited {timeout:g} s for {work.lock}, held by {holder.describe()}; "
                  f"{work.instead}", CacheWarning, stacklevel=4)


def _wait(path: str, work: Work, timeout: float, stale_s: float, done: Callable[[], bool],
          holder: Holder) -> Lease | None:
    """Sleep until the work is done (None), the lease is ours, or `timeout` passes (None, one warning)."""
    deadline, sleep, watch = time.monotonic() + timeout, _FIRST_LOOK_S, _Watch()
    with progress.step(f"waiting for {holder.describe()}, which is {work.doing}"):
        while True:
            if done():
                return None
            current = read_holder(path)
            if current is None or watch.stale(current, stale_s):
                if current is not None:
                    break_lease(path, current)
                lease = try_take(path, timeout, min(2.0, stale_s / 5))
                if lease is not None:
                    return lease
                continue
            if time.monotonic() >= deadline:
                _timed_out(work, timeout, current)
                return None
            time.sleep(min(sleep, max(deadline - time.monotonic(), 0.0)))
            sleep = min(sleep * 2, _LONGEST_SLEEP_S)


def take_lease(path: str, work: Work, timeout: float, done: Callable[[], bool],
               stale_s: float | None = None) -> Lease | None:
    """The lease at `path` for `work`, held by this process (renewed until released, for at most `timeout`
    seconds); None when `done()` says the work was done meanwhile (an entry stored, a library built), or when
    another process held the lease past `timeout` (one warning naming it). Raises OSError when the folder cannot
    be written."""
    stale_s = lease_stale_from_env() if stale_s is None else stale_s
    while (lease := try_take(path, timeout, min(2.0, stale_s / 5))) is None:
        holder = read_holder(path)
        if holder is not None:      # else released just now: take it
            return _wait(path, work, timeout, stale_s, done, holder)
    return lease

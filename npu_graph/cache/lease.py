"""Compile leases: the file that names the one process compiling a cache entry, on any host sharing the cache.

A lease is `locks/<key>.lease`, a small JSON record {host, pid, space, start, token, beat}. It is written whole
into a file of its own and hard-linked into place: the link fails when the name exists, atomically on local file
systems and on NFS, so no flock is needed (where hard links are refused, an O_EXCL create takes its place). Its
holder renews it (the heartbeat: the record rewritten with `beat` + 1 and renamed over the lease) every
`heartbeat_s` seconds from one thread of the process, for at most `hold_s` seconds (a compile that hangs stops
renewing), and removes it when done.

Another process judges a lease by what it reads, never by clocks of other hosts: a lease whose content has not
changed for `stale_s` seconds of the reader's own monotonic clock is stale (reading the file, not its mtime,
also sees a new record through NFS's attribute cache: an open revalidates). A holder in the reader's own process
space (the same boot and pid namespace) that no longer exists is stale at once. A stale lease is broken by
renaming it aside; when the renamed file turns out to be a fresh lease taken meanwhile, it is linked back.
Nothing depends on a lease for correctness: entries are renamed into place whole, so when a lease is broken
under a holder that was only slow, two processes compile and one entry is stored.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

_NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV)


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def process_space() -> str:
    """What makes a pid name one process: this boot and this pid namespace ("" where /proc does not say)."""
    boot = _read_text("/proc/sys/kernel/random/boot_id")
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{boot}/{namespace}" if boot and namespace else ""


def process_start(pid: int) -> str:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat), so a reused pid is told apart; ""
    where unknown."""
    fields = _read_text(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else ""


def _process_gone(pid: int, start: str) -> bool:
    """Whether process `pid` (of this process space) has ended: missing, a zombie, or another process that
    reused its pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    fields = _read_text(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
    if fields and fields[0] in ("Z", "X"):
        return True
    return bool(start) and len(fields) > 19 and fields[19] != start


@dataclass(frozen=True)
class Holder:
    """What a lease file says about its holder; `raw` is the file's content (what a reader watches change)."""
    raw: bytes
    host: str = "?"
    pid: int = 0
    space: str = ""
    start: str = ""
    token: str = ""

    @classmethod
    def parse(cls, raw: bytes) -> Holder:
        try:
            record = json.loads(raw)
            return cls(raw, str(record["host"]), int(record["pid"]), str(record["space"]), str(record["start"]),
                       str(record["token"]))
        except (ValueError, KeyError, TypeError):
            return cls(raw)     # being written (the O_EXCL fallback) or damaged: judged by its heartbeat alone

    def describe(self) -> str:
        return f"process {self.pid} on host {self.host}" if self.pid else "a process (its lease is unreadable)"

    def gone(self) -> bool:
        """Whether the holder is known to have ended: only a process of this process space can be known so."""
        return bool(self.pid and self.space and self.space == process_space() and _process_gone(self.pid, self.start))


def read_holder(path: str) -> Holder | None:
    """The lease at `path`, or None when there is none."""
    try:
        with open(path, "rb") as f:
            return Holder.parse(f.read())
    except FileNotFoundError:
        return None


def _write_record(path: str, record: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)


@dataclass
class Lease:
    """A lease this process holds."""
    path: str
    token: str
    hold_s: float
    every_s: float
    taken: float = field(default_factory=time.monotonic)
    beat: int = 0
    lost: bool = False

    def record(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "space": process_space(),
                "start": process_start(os.getpid()), "token": self.token, "beat": self.beat}

    def _ours(self) -> bool:
        holder = read_holder(self.path)
        return holder is not None and holder.token == self.token

    def renew(self) -> bool:
        """Write the next heartbeat; False once the lease is lost (broken by another process) or held past
        hold_s (the holder then no longer renews it, and others may take it over)."""
        if self.lost or time.monotonic() - self.taken > self.hold_s or not self._ours():
            self.lost = True
            return False
        self.beat += 1
        tmp = f"{self.path}.{self.token}.{self.beat}.tmp"
        try:
            _write_record(tmp, self.record())
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return True

    def release(self) -> None:
        """Give the lease up (remove its file if it is still ours)."""
        HEARTBEAT.drop(self)
        self.lost = True
        with contextlib.suppress(OSError):
            if Holder.parse(Path(self.path).read_bytes()).token == self.token:
                os.unlink(self.path)


def try_take(path: str, hold_s: float, every_s: float) -> Lease | None:
    """Take the lease at `path` if nobody holds it, to be renewed every `every_s` seconds for at most `hold_s`;
    None when another process holds it. Raises OSError when the folder cannot be written."""
    lease = Lease(path, secrets.token_hex(8), hold_s, every_s)
    tmp = f"{path}.{lease.token}.tmp"
    _write_record(tmp, lease.record())
    try:
        os.link(tmp, path)
    except FileExistsError:
        return None
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        try:    # a file system without hard links: an exclusive create, its content written just after
            _write_record(path, lease.record())
        except FileExistsError:
            return None
    finally:
        os.unlink(tmp)
    HEARTBEAT.add(lease)
    return lease


def break_lease(path: str, stale: Holder) -> None:
    """Remove the lease at `path` if it still is `stale` (its content): it is renamed aside first, and linked
    back when what was renamed is a lease taken or renewed meanwhile."""
    aside = f"{path}.broken-{secrets.token_hex(8)}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    try:
        with open(aside, "rb") as f:
            moved = f.read()
        if moved != stale.raw:
            with contextlib.suppress(OSError):   # a lease exists again: the holder lost it, harmlessly
                os.link(aside, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(aside)


class _Heartbeat:
    """The thread that renews every lease this process holds."""

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, lease: Lease) -> None:
        with self._lock:
            self._leases[lease.token] = lease
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ascend-dsa cache lease", daemon=True)
                self._thread.start()
        self._wake.set()

    def drop(self, lease: Lease) -> None:
        with self._lock:
            self._leases.pop(lease.token, None)

    def _run(self) -> None:
        """Renew each lease when it is due; end when none is left (add starts a new thread)."""
        due: dict[str, float] = {}
        while True:
            with self._lock:
                if not self._leases:
                    self._thread = None
                    return
                leases = dict(self._leases)
            now = time.monotonic()
            for token, lease in leases.items():
                if due.setdefault(token, now + lease.every_s) <= now:
                    due[token] = now + lease.every_s
                    if not lease.renew():
                        self.drop(lease)
            due = {token: when for token, when in due.items() if token in leases}
            self._wake.wait(max(min(due.values()) - time.monotonic(), 0.0))
            self._wake.clear()


HEARTBEAT = _Heartbeat()

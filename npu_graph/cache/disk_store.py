"""The on-disk compile cache: the tree and its trust checks, locks, loading and storing, quarantine, LRU, counters.

Layout under the root (ASCEND_DSA_CACHE_DIR, else $XDG_CACHE_HOME/ascend_dsa, else ~/.cache/ascend_dsa, as the
native kernels' build cache picks its folder), entry schema version in the path:
    v2/entries/<key>/       one entry (npu_graph.cache.folder: compiled.py, constants, meta.json, tag)
    v2/locks/<key>.lease    the lease of the process compiling an entry (host, pid, heartbeat), across hosts
    v2/tmp/                 entries being written (renamed into entries/ when complete)
    v2/quarantine/          entries that failed a check, moved aside
    v2/stats.json           cumulative counters
Trust (npu_graph.cache.trust): the root (after resolving a link the user gave as the root) and the folders in it are
created 0700; a tree owned by another user or writable by group or others is refused as a whole, and the
graphs are compiled without it. Each entry is checked (owner, mode, no links, its tag under the user's key, its
hashes) before any of its code runs; an entry that fails is quarantined with one warning and recompiled. Names
in entries/ that are not keys (a `.DS_Store`) are ignored.
A cache that cannot be written (a read-only mount, a container image) still serves hits and writes nothing;
the first write that fails (a full disk too) gives one warning, and graphs compiled after it are not stored.
A process that finds an entry's lease held (npu_graph.cache.locks) sleeps with a status line on stderr naming the
holder's host and pid until the entry is stored, or the lease is given up or goes stale (its holder died or
hung), for at most ASCEND_DSA_CACHE_LOCK_TIMEOUT seconds (600); then it warns and compiles the graph itself.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

from npu_graph.cache.entry import Artifact, artifact_files, artifact_from, artifact_record
from npu_graph.cache.folder import (
    META,
    SCHEMA,
    CorruptEntry,
    EntryBytes,
    EntryGone,
    read_folder,
    verify_entry,
    write_entry,
)
from npu_graph.cache.lease import Lease
from npu_graph.cache.locks import CacheWarning, entry_work, lease_stale_from_env, lock_timeout_from_env, take_lease
from npu_graph.cache.trust import (
    UntrustedPath,
    check_private_dir,
    ensure_private_dir,
    key_path,
    read_private_file,
    user_key,
)

_COUNTERS = {"hit": "hits", "miss": "misses", "bypass": "bypasses", "store": "stores"}
_KEY = re.compile(r"[0-9a-f]{64}")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _folder_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of a folder, None when it is gone: a replaced entry is another folder."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def default_root() -> str:
    """ASCEND_DSA_CACHE_DIR, else $XDG_CACHE_HOME/ascend_dsa (an absolute XDG_CACHE_HOME: the XDG spec says to
    ignore a relative one), else ~/.cache/ascend_dsa."""
    if os.environ.get("ASCEND_DSA_CACHE_DIR"):
        return os.environ["ASCEND_DSA_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ascend_dsa")


class DiskCache:
    """One cache root. Safe for many processes at once.

    `refused` says why the cache cannot be used at all (None when it can), `read_only` why nothing is stored.
    With create=False nothing is created (the command line's read-only commands): a missing root is refused,
    a missing tree is an empty cache, and a missing key leaves every entry unverifiable (`key_problem`)."""

    def __init__(self, root: str | None = None, max_size: int = 2 << 30, create: bool = True,
                 lock_timeout: float | None = None, lease_stale: float | None = None):
        self.root = os.path.abspath(root or default_root())
        self.lock_timeout = lock_timeout_from_env() if lock_timeout is None else lock_timeout
        self.lease_stale = lease_stale_from_env() if lease_stale is None else lease_stale
        self.base = os.path.join(os.path.realpath(self.root), SCHEMA)
        self.max_size = max_size
        self.read_only: str | None = None
        self.key: bytes | None = None
        self.key_problem = ""
        self._rejected: set[str] = set()
        self.refused: str | None = self._open_tree(create)
        if self.refused is None:
            self._open_key(create)

    def _path(self, *parts: str) -> str:
        return os.path.join(self.base, *parts)

    def _open_tree(self, create: bool) -> str | None:
        """Check (with create: make) the private tree; returns why it cannot be used, or None."""
        try:
            if create:
                for folder in (os.path.dirname(self.base), self.base, self._path("entries")):
                    ensure_private_dir(folder)
                for sub in ("locks", "tmp", "quarantine"):
                    self._ensure_writable_dir(sub)
            else:
                check_private_dir(os.path.dirname(self.base))
                for sub in ("", "entries", "locks", "tmp", "quarantine"):
                    if os.path.lexists(self._path(sub)):
                        check_private_dir(self._path(sub))
        except UntrustedPath as exc:
            return f"not using {self.root}: {exc}"
        except FileNotFoundError:
            return f"there is no cache at {self.root}"
        except OSError as exc:
            return f"cannot use {self.root} ({exc.strerror or exc})"
        return None

    def _ensure_writable_dir(self, sub: str) -> None:
        try:
            ensure_private_dir(self._path(sub))
        except UntrustedPath:
            raise
        except OSError as exc:  # a read-only tree without this folder: hits are still served
            self.cannot_write(exc)

    def _open_key(self, create: bool) -> None:
        try:
            self.key = user_key(create=create)
        except UntrustedPath as exc:
            self.refused = f"not using the cache key: {exc}"
        except OSError as exc:
            if create or not isinstance(exc, FileNotFoundError):
                self.refused = f"cannot make or read the cache key at {key_path()} ({exc.strerror or exc})"
            else:
                self.key_problem = f"there is no cache key at {key_path()}, so no entry can be verified"

    def cannot_write(self, exc: OSError) -> None:
        """Turn storing off, with one warning the first time."""
        if self.read_only is None:
            self.read_only = (f"the disk holding {self.root} is full ({exc.strerror})" if exc.errno in _DISK_FULL
                              else f"{self.root} cannot be written ({exc.strerror or exc})")
            warnings.warn(f"ascend_dsa cache: {self.read_only}; cached graphs are still used, graphs compiled now "
                          f"are not stored", CacheWarning, stacklevel=3)

    def entry_dir(self, key: str) -> str:
        if not _KEY.fullmatch(key):
            raise ValueError(f"not a cache key: {key!r}")
        return self._path("entries", key)

    def _names(self) -> list[str]:
        try:
            return sorted(os.listdir(self._path("entries")))
        except OSError:
            return []

    def entry_keys(self) -> list[str]:
        return [name for name in self._names() if _KEY.fullmatch(name)]

    def unknown_names(self) -> list[str]:
        """Names in entries/ that are not entries (ignored by everything but `cache verify` and `cache clear`)."""
        return [name for name in self._names() if not _KEY.fullmatch(name)]

    def _take_lock(self, name: str) -> int:
        fd = os.open(self._path("locks", name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        with contextlib.suppress(OSError):  # a file system without flock: renames still keep entries whole
            fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def lease_path(self, key: str) -> str:
        return self._path("locks", self.entry_dir(key).rsplit(os.sep, 1)[-1] + ".lease")

    def take_lease(self, key: str) -> Lease | None:
        """The entry's lease (npu_graph.cache.locks), or None: the entry was stored meanwhile, or another process
        held the lease past `lock_timeout`."""
        return take_lease(self.lease_path(key), entry_work(key), self.lock_timeout,
                          lambda: os.path.lexists(self.entry_dir(key)), self.lease_stale)

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """While compiling entry `key`: its lease, so that processes sharing the cache, on any host, compile it
        once; returns at once when the entry was stored meanwhile. When the lease cannot be written, the cache is
        read-only from then on (one warning) and this holds none; when another process holds it past
        `lock_timeout`, this holds none either (one warning: storing stays safe, as entries are renamed into
        place whole)."""
        lease = None
        if self.read_only is None:
            try:
                lease = self.take_lease(key)
            except OSError as exc:
                self.cannot_write(exc)
        try:
            yield
        finally:
            if lease is not None:
                lease.release()

    def read_entry(self, key: str) -> tuple[dict[str, Any], EntryBytes]:
        """The entry's meta.json and contents after every check (npu_graph.cache.folder); raises CorruptEntry
        (EntryGone when the entry is gone). An entry replaced while it was read (store's `replace`) is read again."""
        if self.key is None:
            raise CorruptEntry(self.key_problem)
        folder = self.entry_dir(key)
        while True:
            before = _folder_id(folder)
            try:
                entry = read_folder(folder)
                return verify_entry(key, entry, [self.key]), entry
            except CorruptEntry:
                after = _folder_id(folder)
                if after is None:
                    raise EntryGone("the entry was removed while it was read") from None
                if after == before:
                    raise

    def read_meta(self, key: str) -> dict[str, Any]:
        return self.read_entry(key)[0]

    def load(self, key: str) -> tuple[Artifact, dict[str, Any]] | None:
        """The entry's artifact, or None on a miss; an entry that fails a check is quarantined, one warning."""
        if key in self._rejected or not os.path.lexists(self.entry_dir(key)):
            return None
        try:
            meta, entry = self.read_entry(key)
            artifact = artifact_from(meta, entry.files)
        except EntryGone:
            return None
        except CorruptEntry as exc:
            self.reject(key, str(exc))
            return None
        if self.read_only is None:
            with contextlib.suppress(OSError):  # the LRU stamp is best effort
                os.utime(os.path.join(self.entry_dir(key), META), follow_symlinks=False)
        return artifact, meta

    def reject(self, key: str, reason: str) -> None:
        """Quarantine an entry that cannot be used and say so once (a read-only cache keeps it: it is then not
        read again by this object); the caller recompiles."""
        if self.quarantine(key):
            where = "moved to quarantine"
        else:
            where = "left in place"
            self._rejected.add(key)
        warnings.warn(f"ascend_dsa cache: entry {key[:12]} is not used: {reason}; {where}, recompiling",
                      CacheWarning, stacklevel=3)

    def quarantine(self, key: str) -> bool:
        """Move an entry into quarantine/; False when it cannot be moved (a read-only cache, or it is gone)."""
        target = self._path("quarantine", f"{key}-{time.time_ns()}")
        try:
            os.rename(self.entry_dir(key), target)
        except OSError:
            return False
        return True

    def store(self, key: str, artifact: Artifact, meta: dict[str, Any], replace: bool = False) -> int:
        """Write the entry atomically; returns its size in bytes (0 when another process stored it first, or
        when the cache cannot be written: then one warning, the first time). With `replace`, an entry already
        there is replaced (renamed aside, then the new one renamed into place: a reader sees one or the other)."""
        if self.read_only is not None or self.key is None:
            return 0
        full = {**meta, "created": time.time(), "artifact": artifact_record(artifact), "summary": artifact.summary}
        try:
            tmp = tempfile.mkdtemp(prefix=key[:12] + "-", dir=self._path("tmp"))
        except OSError as exc:
            self.cannot_write(exc)
            return 0
        try:
            size = write_entry(tmp, key, artifact_files(artifact), full, self.key)
            if replace:
                self._retire(key)
            os.rename(tmp, self.entry_dir(key))
            return size
        except OSError as exc:
            if not os.path.lexists(self.entry_dir(key)):
                self.cannot_write(exc)
            return 0
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _retire(self, key: str) -> None:
        """Move entry `key` out of entries/ and delete it (nothing when there is none)."""
        aside = self._path("tmp", f"{key[:12]}-retired-{time.time_ns()}")
        try:
            os.rename(self.entry_dir(key), aside)
        except FileNotFoundError:
            return
        shutil.rmtree(aside, ignore_errors=True)

    def record(self, event: str, reason: str | None = None, nbytes: int = 0) -> None:
        """Add one event (hit, miss, bypass, store) to the counters in stats.json. Best effort: a cache that
        cannot be written keeps no counters and says nothing about it."""
        if self.read_only is not None:
            return
        with contextlib.suppress(OSError):
            fd = self._take_lock("stats")
            try:
                stats = self._counters()
                counter = _COUNTERS[event]
                stats[counter] = stats.get(counter, 0) + 1
                if reason:
                    reasons = stats.setdefault("bypass_reasons", {})
                    reasons[reason] = reasons.get(reason, 0) + 1
                stats["bytes_written"] = stats.get("bytes_written", 0) + nbytes
                tmp = self._path(f"stats.json.{os.getpid()}.tmp")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                fd_tmp = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd_tmp, "w") as f:
                    json.dump(stats, f)
                os.replace(tmp, self._path("stats.json"))
            finally:
                os.close(fd)

    def _counters(self) -> dict[str, Any]:
        try:
            counters = json.loads(read_private_file(self._path("stats.json")))
        except (OSError, ValueError):
            return {}
        return counters if isinstance(counters, dict) else {}

    def stats(self) -> dict[str, Any]:
        entries = self.entries_by_recency()
        return {"root": self.root, "entries": len(entries), "bytes": sum(e["size"] for e in entries),
                "max_size": self.max_size, **self._counters()}

    def entry_info(self, key: str) -> dict[str, Any]:
        """Size and last use of an entry, damaged or not; raises OSError when it is gone."""
        folder = self.entry_dir(key)
        st = os.lstat(folder)
        size, used = st.st_size, st.st_mtime
        if stat.S_ISDIR(st.st_mode):
            with contextlib.suppress(OSError):
                size = sum(os.lstat(os.path.join(folder, n)).st_size for n in os.listdir(folder))
            with contextlib.suppress(OSError):
                used = os.lstat(os.path.join(folder, META)).st_mtime
        return {"key": key, "size": size, "last_used": used}

    def entries_by_recency(self) -> list[dict[str, Any]]:
        """Entries, least recently used first."""
        infos = []
        for key in self.entry_keys():
            with contextlib.suppress(OSError):
                infos.append(self.entry_info(key))
        return sorted(infos, key=lambda info: info["last_used"])

    def remove(self, name: str) -> str | None:
        """Remove one name from entries/ (an entry, a link, a stray file); returns why it is still there."""
        path = self._path("entries", os.path.basename(name))
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return f"{type(exc).__name__}: {exc.strerror or exc}"
        return None

    def prune(self, max_size: int | None = None, older_than: float | None = None) -> dict[str, Any]:
        """Evict least recently used entries until the total is <= max_size, and entries unused for `older_than`
        seconds. Returns {"removed": keys, "left": {key: why it could not be removed}}."""
        limit = self.max_size if max_size is None else max_size
        entries = self.entries_by_recency()
        total, now = sum(e["size"] for e in entries), time.time()
        removed, left = [], {}
        for info in entries:
            if total > limit or (older_than is not None and now - info["last_used"] > older_than):
                problem = self.remove(info["key"])
                if problem:
                    left[info["key"]] = problem
                    continue
                removed.append(info["key"])
                total -= info["size"]
        return {"removed": removed, "left": left}

    def clear(self) -> dict[str, Any]:
        """Remove everything in entries/; returns {"removed": count, "left": {name: why it is still there}}."""
        names = self._names()
        left = {name: problem for name in names if (problem := self.remove(name))}
        return {"removed": len(names) - len(left), "left": left}

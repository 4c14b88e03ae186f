"""The on-disk compile cache: entries, locks, integrity checks, quarantine, LRU and counters.

Layout under the root (ASCEND_DSA_CACHE_DIR, else ~/.cache/ascend_dsa), schema version in the path:
    v1/entries/<key>/{meta.json, compiled.py, constants.safetensors}
    v1/locks/<key>.lock     one lock per entry, held while compiling it
    v1/tmp/                 entries being written (renamed into entries/ when complete)
    v1/quarantine/          corrupt or foreign entries moved aside
    v1/stats.json           cumulative counters
Directories are 0700, files 0600. An entry is written into tmp/ and renamed into place, so readers never see a
partial entry; an entry whose files do not match the hashes in meta.json is a miss (quarantined, one warning).
A hit touches meta.json, so pruning evicts the least recently used entries first.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

from safetensors.torch import load_file, save_file

from npu_graph.cache_entry import Artifact

SCHEMA = "v1"
_COUNTERS = {"hit": "hits", "miss": "misses", "bypass": "bypasses", "store": "stores"}


class CacheWarning(UserWarning):
    """The cache refused or repaired something; compilation goes on without it."""


class CorruptEntry(Exception):
    """An entry that cannot be trusted: missing files, bad hashes, wrong schema or owner."""


def default_root() -> str:
    return os.environ.get("ASCEND_DSA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ascend_dsa")


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def verified_meta(folder: str, key: str) -> dict[str, Any]:
    """meta.json of an entry folder, after checking schema, key and every file's hash; raises CorruptEntry."""
    try:
        with open(os.path.join(folder, "meta.json")) as f:
            meta = json.load(f)
        if meta.get("schema") != SCHEMA or meta.get("key") != key:
            raise CorruptEntry(f"schema/key mismatch ({meta.get('schema')!r})")
        for name, digest in meta["files"].items():
            if sha256_file(os.path.join(folder, name)) != digest:
                raise CorruptEntry(f"{name} does not match its hash")
        return meta
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptEntry(f"{type(exc).__name__}: {exc}") from exc


class DiskCache:
    """One cache root. Safe for many processes at once."""

    def __init__(self, root: str | None = None, max_size: int = 2 << 30):
        self.root = os.path.abspath(root or default_root())
        self.base = os.path.join(self.root, SCHEMA)
        self.max_size = max_size
        self.refused: str | None = None
        self._make_dirs()

    def _make_dirs(self) -> None:
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            mode = os.stat(self.root).st_mode
            if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
                self.refused = f"cache root {self.root} is world-writable"
                warnings.warn(f"ascend_dsa cache: {self.refused}; the cache is not used (chmod o-w it)",
                              CacheWarning, stacklevel=3)
                return
            for sub in ("entries", "locks", "tmp", "quarantine"):
                os.makedirs(os.path.join(self.base, sub), mode=0o700, exist_ok=True)
        except OSError as exc:
            self.refused = f"cache root {self.root} is not usable ({exc})"

    def entry_dir(self, key: str) -> str:
        if not key or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"not a cache key: {key!r}")
        return os.path.join(self.base, "entries", key)

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """Exclusive per-entry lock (fcntl), so concurrent processes compile an entry once."""
        path = os.path.join(self.base, "locks", key + ".lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def entry_keys(self) -> list[str]:
        folder = os.path.join(self.base, "entries")
        return sorted(os.listdir(folder)) if os.path.isdir(folder) else []

    def read_meta(self, key: str) -> dict[str, Any]:
        """The entry's meta.json after checking owner, schema and file hashes; raises CorruptEntry."""
        folder = self.entry_dir(key)
        try:
            if os.stat(folder).st_uid != os.getuid():
                raise CorruptEntry("entry is owned by another user")
        except OSError as exc:
            raise CorruptEntry(f"{type(exc).__name__}: {exc}") from exc
        return verified_meta(folder, key)

    def load(self, key: str) -> tuple[Artifact, dict[str, Any]] | None:
        """The entry's artifact, or None on a miss; a corrupt entry is quarantined with one warning."""
        if not os.path.isdir(self.entry_dir(key)):
            return None
        try:
            meta = self.read_meta(key)
            artifact = self._artifact(key, meta)
        except CorruptEntry as exc:
            self.quarantine(key, str(exc))
            return None
        os.utime(os.path.join(self.entry_dir(key), "meta.json"))
        return artifact, meta

    def _artifact(self, key: str, meta: dict[str, Any]) -> Artifact:
        folder = self.entry_dir(key)
        try:
            with open(os.path.join(folder, "compiled.py")) as f:
                source = f.read()
            constants_path = os.path.join(folder, "constants.safetensors")
            constants = load_file(constants_path) if os.path.exists(constants_path) else {}
            a = meta["artifact"]
            return Artifact(source, a["global_names"], constants, a["param_fqns"], a["guards"], a["symbols"],
                            meta.get("summary", {}), a.get("prologue_params", []))
        except Exception as exc:  # a damaged safetensors file raises library-specific errors
            raise CorruptEntry(f"{type(exc).__name__}: {exc}") from exc

    def quarantine(self, key: str, reason: str) -> None:
        target = os.path.join(self.base, "quarantine", f"{key}-{int(time.time() * 1e3)}")
        with contextlib.suppress(OSError):
            os.rename(self.entry_dir(key), target)
        warnings.warn(f"ascend_dsa cache: entry {key[:12]} is unusable ({reason}); moved to quarantine and "
                      f"recompiling", CacheWarning, stacklevel=3)

    def store(self, key: str, artifact: Artifact, meta: dict[str, Any]) -> int:
        """Write the entry atomically; returns its size in bytes (0 when another process stored it first)."""
        tmp = tempfile.mkdtemp(prefix=key[:12] + "-", dir=os.path.join(self.base, "tmp"))
        try:
            _write_private(os.path.join(tmp, "compiled.py"), artifact.source.encode())
            if artifact.constants:
                save_file(artifact.constants, os.path.join(tmp, "constants.safetensors"))
                os.chmod(os.path.join(tmp, "constants.safetensors"), 0o600)
            files = {name: sha256_file(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
            full = {**meta, "schema": SCHEMA, "key": key, "files": files, "created": time.time(),
                    "artifact": {"global_names": artifact.global_names, "param_fqns": artifact.param_fqns,
                                 "guards": artifact.guards, "symbols": artifact.symbols,
                                 "prologue_params": artifact.prologue_params},
                    "summary": artifact.summary}
            _write_private(os.path.join(tmp, "meta.json"), json.dumps(full, indent=1, default=str).encode())
            size = sum(os.path.getsize(os.path.join(tmp, n)) for n in os.listdir(tmp))
            try:
                os.rename(tmp, self.entry_dir(key))
            except OSError:
                return 0
            return size
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def record(self, event: str, reason: str | None = None, nbytes: int = 0) -> None:
        """Add one event (hit, miss, bypass, store) to the cumulative counters in stats.json."""
        with self._stats_lock() as stats:
            counter = _COUNTERS[event]
            stats[counter] = stats.get(counter, 0) + 1
            if reason:
                stats.setdefault("bypass_reasons", {})[reason] = stats["bypass_reasons"].get(reason, 0) + 1
            stats["bytes_written"] = stats.get("bytes_written", 0) + nbytes

    @contextlib.contextmanager
    def _stats_lock(self) -> Iterator[dict[str, Any]]:
        path = os.path.join(self.base, "stats.json")
        with self.lock("stats"):
            try:
                with open(path) as f:
                    stats = json.load(f)
            except (OSError, ValueError):
                stats = {}
            yield stats
            tmp = f"{path}.{os.getpid()}.tmp"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            _write_private(tmp, json.dumps(stats).encode())
            os.replace(tmp, path)

    def stats(self) -> dict[str, Any]:
        try:
            with open(os.path.join(self.base, "stats.json")) as f:
                counters = json.load(f)
        except (OSError, ValueError):
            counters = {}
        entries = self.entries_by_recency()
        return {"root": self.root, "entries": len(entries), "bytes": sum(e["size"] for e in entries),
                "max_size": self.max_size, **counters}

    def entry_info(self, key: str) -> dict[str, Any]:
        folder = self.entry_dir(key)
        size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
        return {"key": key, "size": size, "last_used": os.path.getmtime(os.path.join(folder, "meta.json"))}

    def entries_by_recency(self) -> list[dict[str, Any]]:
        """Entries, least recently used first."""
        infos = []
        for key in self.entry_keys():
            with contextlib.suppress(OSError):
                infos.append(self.entry_info(key))
        return sorted(infos, key=lambda info: info["last_used"])

    def remove(self, key: str) -> None:
        shutil.rmtree(self.entry_dir(key), ignore_errors=True)

    def prune(self, max_size: int | None = None, older_than: float | None = None) -> list[str]:
        """Evict least recently used entries until the total is <= max_size, and entries unused for
        `older_than` seconds. Returns the removed keys."""
        limit = self.max_size if max_size is None else max_size
        entries = self.entries_by_recency()
        total, removed, now = sum(e["size"] for e in entries), [], time.time()
        for info in entries:
            if total > limit or (older_than is not None and now - info["last_used"] > older_than):
                self.remove(info["key"])
                removed.append(info["key"])
                total -= info["size"]
        return removed

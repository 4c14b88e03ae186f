"""Ship a warmed compile cache to another machine: export to one .tar.gz, import with checks.

Export packs every entry that verifies, with its tag, and lists every member's size in manifest.json. Import
reads nothing of a member before its size in the archive's header matches the manifest's (manifest.json, meta.json
and tags have small bounds of their own), and reads an entry's files only once its tag verifies (unless trusted):
an archive cannot make the importer hold data it will refuse. Import refuses an archive made with other versions
(python, torch, torch_npu, ascend-dsa) or holding anything but regular files named entries/<key>/<entry file>
and manifest.json, each once (absolute paths, `..`, links and device files never reach the disk). Each entry
must then verify as the cache checks it, tag included: an entry tagged under another key (another user,
another machine) is refused unless the caller trusts the archive (`trust`) or shares the key it was made with
(`key_file`). Accepted entries are re-tagged under this user's key and installed atomically.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from npu_graph.cache.disk_store import DiskCache
from npu_graph.cache.folder import (
    META,
    SCHEMA,
    TAG,
    CorruptEntry,
    EntryBytes,
    check_tag,
    verify_entry,
    write_entry,
)
from npu_graph.cache.key import versions
from npu_graph.cache.trust import KEY_BYTES, read_private_file

_MEMBER = re.compile(r"entries/([0-9a-f]{64})/(meta\.json|compiled\.py|constants\.safetensors|tag)")
_ARCHIVE_ERRORS = (OSError, EOFError, tarfile.TarError, zlib.error)
_MANIFEST_LIMIT = 64 << 20      # bytes of manifest.json (a key and a size per member: ~200 bytes an entry file)
_META_LIMIT = 1 << 20           # bytes of an entry's meta.json or tag


class CacheImportError(RuntimeError):
    """The archive cannot be imported as it is (versions differ, unexpected members, unreadable, ...)."""


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
    tar.addfile(info, io.BytesIO(data))


def export_cache(disk: DiskCache, path: str) -> dict[str, Any]:
    """Pack every entry that verifies (written to a temporary file, renamed to `path` when complete); returns
    what was written and the entries skipped, with why."""
    keys, skipped, sizes = [], [], {}
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".ascend-dsa-export-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w:gz") as tar:
            for key in disk.entry_keys():
                try:
                    _, entry = disk.read_entry(key)
                except CorruptEntry as exc:
                    skipped.append({"key": key, "problem": str(exc)})
                    continue
                members = {**entry.files, META: entry.meta, TAG: entry.tag.encode()}
                for name, data in members.items():
                    _add(tar, f"entries/{key}/{name}", data)
                    sizes[f"entries/{key}/{name}"] = len(data)
                keys.append(key)
            _add(tar, "manifest.json", json.dumps({"schema": SCHEMA, "versions": versions(), "keys": keys,
                                                   "sizes": sizes}).encode())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"file": path, "entries": len(keys), "skipped": skipped}


def _read_small(tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int) -> bytes:
    """A member whose header says it holds at most `limit` bytes, read whole (the size is checked before reading)."""
    if member.size > limit:
        raise CacheImportError(f"{member.name} holds {member.size} bytes, more than the {limit} such a file may "
                               f"hold; refusing the archive")
    return tar.extractfile(member).read(limit)


def _check_manifest(tar: tarfile.TarFile) -> dict[str, int] | None:
    """The manifest's member sizes (None when it lists none), after checking its schema and versions."""
    try:
        manifest = json.loads(_read_small(tar, tar.getmember("manifest.json"), _MANIFEST_LIMIT))
        archived = dict(manifest.get("versions", {}))
        sizes = {str(name): int(size) for name, size in manifest.get("sizes", {}).items()}
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise CacheImportError(f"not an ascend-dsa cache export (manifest.json: {exc})") from exc
    differ = {k: (archived.get(k), v) for k, v in versions().items() if archived.get(k) != v}
    if manifest.get("schema") != SCHEMA or differ:
        details = ", ".join(f"{k}: archive {a} vs here {b}" for k, (a, b) in differ.items())
        raise CacheImportError(f"cache export was made with other versions ({details or manifest.get('schema')}); "
                               f"recompile on this machine instead")
    return sizes if "sizes" in manifest else None


def _members_by_key(tar: tarfile.TarFile) -> dict[str, list[tarfile.TarInfo]]:
    grouped: dict[str, list[tarfile.TarInfo]] = {}
    seen = set()
    for member in tar.getmembers():
        if member.name in seen:
            raise CacheImportError(f"member {member.name!r} appears twice in the cache export; refusing the archive")
        seen.add(member.name)
        if member.name == "manifest.json" and member.isfile():
            continue
        match = _MEMBER.fullmatch(member.name)
        if not match or not member.isfile():
            raise CacheImportError(f"unexpected member {member.name!r} in the cache export (only regular files "
                                   f"named entries/<key>/<entry file> are accepted); refusing the archive")
        grouped.setdefault(match.group(1), []).append(member)
    return grouped


def _check_sizes(grouped: dict[str, list[tarfile.TarInfo]], sizes: dict[str, int] | None) -> None:
    """Every member's size in its header is the one the manifest lists (checked before anything is read)."""
    if sizes is None:
        raise CacheImportError("the cache export's manifest.json lists no member sizes; export it again with "
                               "this version")
    for member in (m for members in grouped.values() for m in members):
        if sizes.get(member.name) != member.size:
            raise CacheImportError(f"member {member.name!r} holds {member.size} bytes, the manifest lists "
                                   f"{sizes.get(member.name, 'no size')}; refusing the archive")


def _entries(tar: tarfile.TarFile, grouped: dict[str, list[tarfile.TarInfo]],
             tag_keys: list[bytes] | None) -> Iterator[tuple[str, EntryBytes | CorruptEntry]]:
    """Each entry as read, or why it is refused: its meta.json and tag first, and its files only when the tag
    verifies under one of `tag_keys` (None: trusted)."""
    for key, members in grouped.items():
        named = {os.path.basename(m.name): m for m in members}
        meta_member, tag_member = named.pop(META, None), named.pop(TAG, None)
        meta = None if meta_member is None else _read_small(tar, meta_member, _META_LIMIT)
        tag_bytes = None if tag_member is None else _read_small(tar, tag_member, _META_LIMIT)
        entry = EntryBytes(meta, None if tag_bytes is None else tag_bytes.decode("ascii", "replace"), {})
        try:
            if meta is not None and tag_keys is not None:
                check_tag(entry, tag_keys)
        except CorruptEntry as exc:
            yield key, exc
            continue
        entry.files.update({name: tar.extractfile(m).read() for name, m in named.items()})
        yield key, entry


def read_key_file(path: str) -> bytes:
    """A key shared for import (another user's or machine's cache.key): a private file of at least 32 bytes."""
    try:
        key = read_private_file(Path(path))
    except OSError as exc:
        raise CacheImportError(f"cannot use the key {path}: {exc.strerror if exc.strerror else exc}") from exc
    if len(key) < KEY_BYTES:
        raise CacheImportError(f"{path} holds {len(key)} bytes; a cache key has at least {KEY_BYTES}")
    return key


def import_cache(disk: DiskCache, path: str, trust: bool = False, key_file: str | None = None) -> dict[str, Any]:
    """Install the archive's entries that verify (tag under this user's key or the key in `key_file`; any tag
    with `trust`), re-tagged under this user's key; existing entries are kept. Returns counts and the refused
    entries with why; raises CacheImportError when the archive as a whole cannot be imported."""
    tag_keys = None if trust else [disk.key, *([read_key_file(key_file)] if key_file else [])]
    imported, refused = 0, []
    try:
        with tarfile.open(path, "r:gz") as tar:
            sizes = _check_manifest(tar)
            grouped = _members_by_key(tar)
            _check_sizes(grouped, sizes)
            new = {key: members for key, members in grouped.items() if not os.path.lexists(disk.entry_dir(key))}
            present = len(grouped) - len(new)
            for key, entry in _entries(tar, new, tag_keys):
                try:
                    if isinstance(entry, CorruptEntry):
                        raise entry
                    meta = verify_entry(key, entry, tag_keys)
                except CorruptEntry as exc:
                    refused.append({"key": key, "problem": str(exc)})
                    continue
                _install(disk, key, entry, meta)
                imported += 1
    except _ARCHIVE_ERRORS as exc:
        raise CacheImportError(f"cannot read {path} as a cache export ({type(exc).__name__}: {exc})") from exc
    return {"imported": imported, "already_present": present, "refused": refused}


def _install(disk: DiskCache, key: str, entry: EntryBytes, meta: dict[str, Any]) -> None:
    try:
        tmp = tempfile.mkdtemp(prefix="import-", dir=os.path.join(disk.base, "tmp"))
        try:
            write_entry(tmp, key, entry.files, meta, disk.key)
            os.rename(tmp, disk.entry_dir(key))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        raise CacheImportError(f"cannot write into the cache at {disk.root} ({exc.strerror or exc})") from exc

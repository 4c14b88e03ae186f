"""One compile-cache entry folder on disk: written whole with a tag under the user's key, read back with every
trust check (npu_graph.cache.trust) made on the very bytes that are then used, before any of them is parsed or run.

An entry folder holds compiled.py, constants.safetensors (when the graph has tensor constants), meta.json
(schema, key, versions, config, the artifact's description and the sha256 of each file) and `tag`: the hex
HMAC-SHA256 of meta.json under the user's key. The tag covers meta.json and meta.json covers every file by its
hash, so an entry whose source was edited (even with its recorded hash fixed up), or that was made under
another key (another user, another machine, an archive built elsewhere), does not verify.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from npu_graph.cache.trust import UntrustedPath, check_private_dir, read_private_file, tag, verify_tag

SCHEMA = "v2"
ENTRY_FILES = ("compiled.py", "constants.safetensors")
META, TAG = "meta.json", "tag"
_TAG_CONTEXT = b"ascend-dsa compile cache entry\n"


class CorruptEntry(Exception):
    """An entry that cannot be trusted: missing or unexpected files, a bad hash or tag, a wrong schema or key,
    or a file or folder that is a link, not ours, or writable by others."""


class EntryGone(CorruptEntry):
    """The entry was removed while it was read (pruned, cleared, or replaced and its old folder deleted)."""


@dataclass
class EntryBytes:
    """An entry's contents as read (from a folder or an archive), not yet verified."""

    meta: bytes | None
    tag: str | None
    files: dict[str, bytes]


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_folder(folder: str, names: Sequence[str] = ENTRY_FILES) -> EntryBytes:
    """The entry folder's contents (the files among `names` it holds), each file read only if it and the folder
    pass the trust checks."""
    try:
        check_private_dir(folder)
        files = {name: read_private_file(os.path.join(folder, name))
                 for name in names if os.path.lexists(os.path.join(folder, name))}
        meta = read_private_file(os.path.join(folder, META))
        tag_path = os.path.join(folder, TAG)
        tag_text = read_private_file(tag_path).decode("ascii", "replace") if os.path.lexists(tag_path) else None
    except UntrustedPath as exc:
        raise CorruptEntry(str(exc)) from exc
    except OSError as exc:
        raise CorruptEntry(f"{type(exc).__name__}: {exc}") from exc
    return EntryBytes(meta, tag_text, files)


def check_tag(entry: EntryBytes, tag_keys: Sequence[bytes]) -> None:
    """The entry's tag verifies its meta.json under one of `tag_keys`; raises CorruptEntry."""
    if entry.tag is None:
        raise CorruptEntry("it carries no tag (made by an older version, or copied without one)")
    if not any(verify_tag(_TAG_CONTEXT + entry.meta, entry.tag, key) for key in tag_keys):
        raise CorruptEntry("its tag does not verify under your key: it was edited, or made by another user or "
                           "on another machine")


def verify_entry(key: str, entry: EntryBytes, tag_keys: Sequence[bytes] | None,
                 required: Sequence[str] = ("compiled.py",)) -> dict[str, Any]:
    """The entry's meta.json after checking its tag under one of `tag_keys` (None: trusted without a tag, as
    `cache import --trust` does), its schema and key, the `required` files and every file against its hash;
    raises CorruptEntry."""
    if entry.meta is None:
        raise CorruptEntry("meta.json is missing")
    if tag_keys is not None:
        check_tag(entry, tag_keys)
    try:
        meta = json.loads(entry.meta)
    except ValueError as exc:
        raise CorruptEntry(f"meta.json is not JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("schema") != SCHEMA or meta.get("key") != key:
        raise CorruptEntry("meta.json is for another schema or key")
    listed = meta.get("files")
    if not isinstance(listed, dict) or set(listed) != set(entry.files) or not set(required) <= set(listed):
        raise CorruptEntry(f"the entry holds {sorted(entry.files)}, meta.json lists "
                           f"{sorted(listed) if isinstance(listed, dict) else listed!r}")
    for name, digest in listed.items():
        if sha256_hex(entry.files[name]) != digest:
            raise CorruptEntry(f"{name} does not match its hash")
    return meta


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_entry(folder: str, key: str, files: dict[str, bytes], meta: dict[str, Any], tag_key: bytes) -> int:
    """Write an entry into `folder` (new and private: it is renamed into place afterwards): the files, meta.json
    (`meta` with schema, key and each file's hash) and meta.json's tag under `tag_key`. Returns its size."""
    for name, data in files.items():
        _write_private(os.path.join(folder, name), data)
    full = {**meta, "schema": SCHEMA, "key": key, "files": {n: sha256_hex(d) for n, d in sorted(files.items())}}
    meta_bytes = json.dumps(full, indent=1, default=str).encode()
    _write_private(os.path.join(folder, META), meta_bytes)
    tag_bytes = tag(_TAG_CONTEXT + meta_bytes, tag_key).encode()
    _write_private(os.path.join(folder, TAG), tag_bytes)
    return sum(len(d) for d in files.values()) + len(meta_bytes) + len(tag_bytes)

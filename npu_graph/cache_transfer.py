"""Ship a warmed compile cache to another machine: export to one .tar.gz, import with checks.

Import refuses an archive made with other versions (python, torch, torch_npu, ascend-dsa), accepts only
regular files named entries/<key>/<known file>, and installs each entry atomically after checking its hashes.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
import tempfile
from typing import Any

from npu_graph.cache_key import versions
from npu_graph.disk_cache import SCHEMA, CorruptEntry, DiskCache, verified_meta

_MEMBER = re.compile(r"entries/([0-9a-f]{64})/(meta\.json|compiled\.py|constants\.safetensors)")


class CacheImportError(RuntimeError):
    """The archive cannot be imported as it is (versions differ, unexpected members, ...)."""


def export_cache(disk: DiskCache, path: str) -> dict[str, Any]:
    """Pack every valid entry; returns what was written."""
    keys = []
    with tarfile.open(path, "w:gz") as tar:
        for key in disk.entry_keys():
            try:
                disk.read_meta(key)
            except CorruptEntry:
                continue
            folder = disk.entry_dir(key)
            for name in sorted(os.listdir(folder)):
                tar.add(os.path.join(folder, name), arcname=f"entries/{key}/{name}", recursive=False)
            keys.append(key)
        manifest = json.dumps({"schema": SCHEMA, "versions": versions(), "keys": keys}).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
    return {"file": path, "entries": len(keys)}


def _check_manifest(tar: tarfile.TarFile) -> dict[str, Any]:
    try:
        manifest = json.load(tar.extractfile("manifest.json"))
    except (KeyError, ValueError, TypeError) as exc:
        raise CacheImportError(f"not an ascend-dsa cache export (manifest.json: {exc})") from exc
    here = versions()
    differ = {k: (manifest.get("versions", {}).get(k), v) for k, v in here.items()
              if manifest.get("versions", {}).get(k) != v}
    if manifest.get("schema") != SCHEMA or differ:
        details = ", ".join(f"{k}: archive {a} vs here {b}" for k, (a, b) in differ.items())
        raise CacheImportError(f"cache export was made with other versions ({details or manifest.get('schema')}); "
                               f"recompile on this machine instead")
    return manifest


def _members_by_key(tar: tarfile.TarFile) -> dict[str, list[tarfile.TarInfo]]:
    grouped: dict[str, list[tarfile.TarInfo]] = {}
    for member in tar.getmembers():
        if member.name == "manifest.json":
            continue
        match = _MEMBER.fullmatch(member.name)
        if not match or not member.isfile():
            raise CacheImportError(f"unexpected member {member.name!r} in cache export; refusing the archive")
        grouped.setdefault(match.group(1), []).append(member)
    return grouped


def import_cache(disk: DiskCache, path: str) -> dict[str, Any]:
    """Install the archive's entries; existing entries are kept. Returns counts."""
    with tarfile.open(path, "r:gz") as tar:
        _check_manifest(tar)
        grouped = _members_by_key(tar)
        imported, skipped = [], []
        for key, members in grouped.items():
            if os.path.isdir(disk.entry_dir(key)):
                skipped.append(key)
                continue
            _install(disk, tar, key, members)
            imported.append(key)
    return {"imported": len(imported), "already_present": len(skipped)}


def _install(disk: DiskCache, tar: tarfile.TarFile, key: str, members: list[tarfile.TarInfo]) -> None:
    tmp = tempfile.mkdtemp(prefix="import-", dir=os.path.join(disk.base, "tmp"))
    try:
        for member in members:
            target = os.path.join(tmp, os.path.basename(member.name))
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(tar.extractfile(member), out)
        try:
            verified_meta(tmp, key)
        except CorruptEntry as exc:
            raise CacheImportError(f"entry {key[:12]} in the archive is damaged ({exc})") from exc
        os.rename(tmp, disk.entry_dir(key))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


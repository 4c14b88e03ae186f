"""Export and import of the compile cache: round trips, archives made under another key (refused unless trusted
or their key is given), and archives that try to write outside the cache or are damaged."""
import io
import json
import os
import tarfile

import pytest
from cache_helpers import add_payload, compile_once, isolated_key, read_only

from npu_graph.cache import key as cache_key
from npu_graph.cache import transfer as cache_transfer
from npu_graph.cache.disk_store import DiskCache
from npu_graph.cache.folder import SCHEMA
from npu_graph.cache.transfer import CacheImportError, export_cache, import_cache
from npu_graph.cache.trust import key_path, read_private_file

own_key = isolated_key()


@pytest.fixture
def foreign_archive(tmp_path, monkeypatch):
    """An archive exported by another user (another key), whose entry's source carries a payload with its hash
    fixed up and a valid tag under that user's key. Returns (archive, their key file, payload marker)."""
    mine = os.environ["ASCEND_DSA_KEY_FILE"]
    theirs = str(tmp_path / "theirs" / "cache.key")
    monkeypatch.setenv("ASCEND_DSA_KEY_FILE", theirs)
    compile_once(tmp_path / "theirs" / "cache")
    disk = DiskCache(str(tmp_path / "theirs" / "cache"))
    (key,) = disk.entry_keys()
    artifact, meta = disk.load(key)
    marker = tmp_path / "payload_ran"
    artifact.source += f"\nimport pathlib; pathlib.Path({str(marker)!r}).touch()\n"
    disk.remove(key)
    disk.store(key, artifact, {k: meta[k] for k in ("versions", "config", "inputs")})
    archive = str(tmp_path / "theirs.tgz")
    export_cache(disk, archive)
    monkeypatch.setenv("ASCEND_DSA_KEY_FILE", mine)
    return archive, theirs, marker


def test_round_trip_under_the_same_key(tmp_path):
    compile_once(tmp_path / "src")
    archive = str(tmp_path / "warm.tgz")
    assert export_cache(DiskCache(str(tmp_path / "src")), archive)["entries"] == 1
    dst = DiskCache(str(tmp_path / "dst"))
    assert import_cache(dst, archive) == {"imported": 1, "already_present": 0, "refused": []}
    assert import_cache(dst, archive)["already_present"] == 1
    assert compile_once(tmp_path / "dst")[0].cache == "hit"


def test_an_archive_made_under_another_key_is_refused(tmp_path, foreign_archive):
    archive, _, marker = foreign_archive
    result = import_cache(DiskCache(str(tmp_path / "mine")), archive)
    assert result["imported"] == 0 and "tag does not verify under your key" in result["refused"][0]["problem"]
    assert DiskCache(str(tmp_path / "mine")).entry_keys() == []
    assert compile_once(tmp_path / "mine")[0].cache == "miss" and not marker.exists()


@pytest.mark.parametrize("how", ["trust", "key_file"])
def test_a_trusted_archive_is_imported_and_re_tagged_under_this_users_key(tmp_path, foreign_archive, how):
    """Trusting an archive means running its code: the payload runs, which is the point of refusing by default."""
    archive, theirs, marker = foreign_archive
    disk = DiskCache(str(tmp_path / "mine"))
    options = {"trust": True} if how == "trust" else {"key_file": theirs}
    assert import_cache(disk, archive, **options)["imported"] == 1
    (key,) = disk.entry_keys()
    disk.read_entry(key)  # verifies under this user's key
    assert compile_once(tmp_path / "mine")[0].cache == "hit" and marker.exists()


def test_a_shared_key_must_be_a_private_key_file(tmp_path, foreign_archive):
    archive, theirs, _ = foreign_archive
    os.chmod(theirs, 0o666)
    with pytest.raises(CacheImportError, match="writable by group or others"):
        import_cache(DiskCache(str(tmp_path / "mine")), archive, key_file=theirs)
    with pytest.raises(CacheImportError, match="No such file"):
        import_cache(DiskCache(str(tmp_path / "mine")), archive, key_file=str(tmp_path / "none"))


def test_an_entry_edited_after_export_is_refused_even_with_trust(tmp_path):
    """--trust skips the tag, never the hashes: an entry damaged in transit is refused."""
    compile_once(tmp_path / "src")
    disk = DiskCache(str(tmp_path / "src"))
    add_payload(disk.entry_dir(disk.entry_keys()[0]), tmp_path / "marker")
    with open(os.path.join(disk.entry_dir(disk.entry_keys()[0]), "constants.safetensors"), "ab") as f:
        f.write(b"x")
    archive = str(tmp_path / "a.tgz")
    export = export_cache(disk, archive)
    assert export["entries"] == 0 and "tag does not verify" in export["skipped"][0]["problem"]


def manifest(**changes) -> bytes:
    return json.dumps({"schema": SCHEMA, "versions": cache_key.versions(), "keys": [], **changes}).encode()


def archive_with(path, *members: tarfile.TarInfo | tuple[str, bytes]) -> str:
    """An archive of `members`; a manifest among them lists their sizes unless it lists sizes itself."""
    sizes = {m[0]: len(m[1]) for m in members if isinstance(m, tuple)}
    members = tuple(("manifest.json", json.dumps({"sizes": sizes, **json.loads(m[1])}).encode())
                    if isinstance(m, tuple) and m[0] == "manifest.json" else m for m in members)
    with tarfile.open(path, "w:gz") as tar:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
            else:
                info = tarfile.TarInfo(member[0])
                info.size = len(member[1])
                tar.addfile(info, io.BytesIO(member[1]))
    return str(path)


def special(name: str, kind: bytes, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


KEY = "ab" * 32


@pytest.mark.parametrize("member", [
    ("/tmp/escaped", b"x"), ("entries/../../escaped", b"x"), (f"entries/{KEY}/../../../escaped", b"x"),
    special(f"entries/{KEY}/compiled.py", tarfile.SYMTYPE, "/etc/passwd"),
    special(f"entries/{KEY}/compiled.py", tarfile.LNKTYPE, "manifest.json"),
    special(f"entries/{KEY}/compiled.py", tarfile.CHRTYPE), special(f"entries/{KEY}/compiled.py", tarfile.FIFOTYPE),
    special(f"entries/{KEY}", tarfile.DIRTYPE), (f"entries/{KEY}/setup.py", b"x"), ("entries/nothex/meta.json", b"{}"),
], ids=["absolute", "dotdot", "dotdot in entry", "symlink", "hardlink", "device", "fifo", "folder", "unknown file",
        "bad key"])
def test_archives_that_reach_outside_the_cache_are_refused(tmp_path, member):
    archive = archive_with(tmp_path / "evil.tgz", ("manifest.json", manifest()), member)
    disk = DiskCache(str(tmp_path / "cache"))
    with pytest.raises(CacheImportError, match=r"unexpected member .*refusing the archive"):
        import_cache(disk, archive)
    assert disk.entry_keys() == [] and not os.path.exists("/tmp/escaped") and not (tmp_path / "escaped").exists()


def test_damaged_archives_are_refused_with_a_message(tmp_path):
    disk = DiskCache(str(tmp_path / "cache"))
    twice = archive_with(tmp_path / "twice.tgz", ("manifest.json", manifest()), (f"entries/{KEY}/tag", b"1"),
                         (f"entries/{KEY}/tag", b"2"))
    junk = tmp_path / "junk.tgz"
    junk.write_bytes(b"not an archive at all")
    good = archive_with(tmp_path / "good.tgz", ("manifest.json", manifest()), (f"entries/{KEY}/tag", b"1" * 64))
    truncated = tmp_path / "truncated.tgz"
    truncated.write_bytes((tmp_path / "good.tgz").read_bytes()[:-30])
    cases = {twice: "appears twice", str(junk): "cannot read", str(truncated): "cannot read",
             str(tmp_path / "missing.tgz"): "cannot read .*No such file",
             archive_with(tmp_path / "bare.tgz", (f"entries/{KEY}/tag", b"1")): "not an ascend-dsa cache export",
             archive_with(tmp_path / "old.tgz", ("manifest.json", manifest(schema="v1"))): "other versions"}
    for archive, message in cases.items():
        with pytest.raises(CacheImportError, match=message):
            import_cache(disk, archive)
    missing = import_cache(disk, good)
    assert missing["refused"] == [{"key": KEY, "problem": "meta.json is missing"}] and disk.entry_keys() == []


def test_import_refuses_other_versions(tmp_path, monkeypatch):
    compile_once(tmp_path / "src")
    archive = str(tmp_path / "a.tgz")
    export_cache(DiskCache(str(tmp_path / "src")), archive)
    monkeypatch.setattr(cache_transfer, "versions", lambda: {**cache_key.versions(), "torch": "0.0.1"})
    with pytest.raises(CacheImportError, match=r"torch: archive .* vs here 0\.0\.1"):
        import_cache(DiskCache(str(tmp_path / "dst")), archive)


def test_import_into_a_read_only_cache_says_so(tmp_path):
    compile_once(tmp_path / "src")
    archive = str(tmp_path / "a.tgz")
    export_cache(DiskCache(str(tmp_path / "src")), archive)
    disk = DiskCache(str(tmp_path / "dst"))
    with read_only(tmp_path / "dst"), pytest.raises(CacheImportError, match="cannot write into the cache"):
        import_cache(disk, archive)
    assert read_private_file(key_path())  # the key was made when the cache was opened, before


def test_a_member_larger_than_the_manifest_says_is_refused_unread(tmp_path, monkeypatch):
    """Sizes are checked from the headers before any member is read: a 64 MB member the manifest lists as 10 bytes
    is refused without being read."""
    big = tarfile.TarInfo(f"entries/{KEY}/constants.safetensors")
    big.size = 64 << 20
    path = tmp_path / "big.tgz"
    with tarfile.open(path, "w:gz") as tar:
        sizes = {big.name: 10}
        data = json.dumps({"schema": SCHEMA, "versions": cache_key.versions(), "keys": [KEY], "sizes": sizes})
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data.encode()))
        tar.addfile(big, io.BytesIO(bytes(big.size)))
    read = []
    extract = tarfile.TarFile.extractfile
    monkeypatch.setattr(tarfile.TarFile, "extractfile", lambda self, m: read.append(getattr(m, "name", m)) or
                        extract(self, m))
    with pytest.raises(CacheImportError, match=r"holds 67108864 bytes, the manifest lists 10"):
        import_cache(DiskCache(str(tmp_path / "cache")), str(path))
    assert big.name not in read


def test_an_untagged_entry_is_refused_before_its_files_are_read(tmp_path, monkeypatch):
    files = {f"entries/{KEY}/compiled.py": b"x" * (8 << 20), f"entries/{KEY}/meta.json": b"{}",
             f"entries/{KEY}/tag": b"0" * 64}
    archive = archive_with(tmp_path / "forged.tgz", ("manifest.json", manifest(keys=[KEY])), *files.items())
    read = []
    extract = tarfile.TarFile.extractfile
    monkeypatch.setattr(tarfile.TarFile, "extractfile", lambda self, m: read.append(m.name) or extract(self, m))
    result = import_cache(DiskCache(str(tmp_path / "cache")), archive)
    assert result["imported"] == 0 and "tag does not verify" in result["refused"][0]["problem"]
    assert f"entries/{KEY}/compiled.py" not in read and f"entries/{KEY}/meta.json" in read


def test_oversized_meta_and_manifests_without_sizes_are_refused(tmp_path):
    disk = DiskCache(str(tmp_path / "cache"))
    meta = archive_with(tmp_path / "meta.tgz", ("manifest.json", manifest()),
                        (f"entries/{KEY}/meta.json", b" " * ((1 << 20) + 1)))
    with pytest.raises(CacheImportError, match=r"meta.json holds 1048577 bytes, more than the 1048576"):
        import_cache(disk, meta)
    bare = tmp_path / "bare.tgz"
    with tarfile.open(bare, "w:gz") as tar:
        data = manifest()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(CacheImportError, match="lists no member sizes; export it again"):
        import_cache(disk, str(bare))

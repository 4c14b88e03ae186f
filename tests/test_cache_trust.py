"""Tampered, foreign, lax and linked cache entries: each is refused with one clear warning and the graph is
recompiled; a payload in a refused entry never runs."""
import os
import re
import shutil

import pytest
from cache_helpers import add_payload, compile_once, isolated_key, one_cache_warning, owned_by_someone_else

from npu_graph.cache.disk_store import DiskCache

own_key = isolated_key()


def only_entry(root) -> str:
    disk = DiskCache(str(root))
    (key,) = disk.entry_keys()
    return disk.entry_dir(key)


def test_edited_source_with_a_fixed_up_hash_never_runs(tmp_path):
    compile_once(tmp_path / "cache")
    marker = tmp_path / "payload_ran"
    add_payload(only_entry(tmp_path / "cache"), marker)
    with one_cache_warning("tag does not verify under your key.*moved to quarantine, recompiling"):
        report, _ = compile_once(tmp_path / "cache")
    assert report.cache == "miss" and not marker.exists()
    assert compile_once(tmp_path / "cache")[0].cache == "hit" and not marker.exists()


def test_an_entry_tagged_under_another_key_never_runs(tmp_path, monkeypatch):
    """The same payload runs when its entry is tagged under this user's key: only the tag stops it."""
    marker = tmp_path / "payload_ran"
    monkeypatch.setenv("ASCEND_DSA_KEY_FILE", str(tmp_path / "theirs" / "cache.key"))
    compile_once(tmp_path / "cache")
    folder = only_entry(tmp_path / "cache")
    disk = DiskCache(str(tmp_path / "cache"))
    key = os.path.basename(folder)
    artifact, meta = disk.load(key)
    artifact.source += f"\nimport pathlib; pathlib.Path({str(marker)!r}).touch()\n"
    shutil.rmtree(folder)
    disk.store(key, artifact, {k: meta[k] for k in ("versions", "config", "inputs")})

    monkeypatch.setenv("ASCEND_DSA_KEY_FILE", str(tmp_path / "mine" / "cache.key"))
    with one_cache_warning("tag does not verify under your key: it was edited, or made by another user"):
        report, _ = compile_once(tmp_path / "cache")
    assert report.cache == "miss" and not marker.exists()

    monkeypatch.setenv("ASCEND_DSA_KEY_FILE", str(tmp_path / "theirs" / "cache.key"))
    shutil.rmtree(folder)
    disk.store(key, artifact, {k: meta[k] for k in ("versions", "config", "inputs")})
    assert compile_once(tmp_path / "cache")[0].cache == "hit" and marker.exists()


def test_an_entry_without_a_tag_is_refused(tmp_path):
    compile_once(tmp_path)
    os.unlink(os.path.join(only_entry(tmp_path), "tag"))
    with one_cache_warning("carries no tag"):
        assert compile_once(tmp_path)[0].cache == "miss"


@pytest.mark.parametrize("where", ["", "v2", "v2/entries", "v2/locks"])
def test_a_tree_others_can_write_is_not_used(tmp_path, where):
    compile_once(tmp_path)
    folder = tmp_path / where
    os.chmod(folder, 0o777)
    with one_cache_warning(re.escape(f"not using {tmp_path}: {folder} is writable by group or others (mode 0777): "
                                     f"run chmod 700 {folder}; compiling without the cache")):
        report, _ = compile_once(tmp_path)
    assert report.cache == "bypass" and "writable by group or others" in report.cache_reason


@pytest.mark.parametrize("name, mode", [("", 0o770), ("compiled.py", 0o666), ("meta.json", 0o620), ("tag", 0o602)])
def test_an_entry_others_can_write_is_refused(tmp_path, name, mode):
    compile_once(tmp_path)
    os.chmod(os.path.join(only_entry(tmp_path), name), mode)
    with one_cache_warning(rf"is writable by group or others \(mode 0{mode:o}\).*quarantine, recompiling"):
        assert compile_once(tmp_path)[0].cache == "miss"


def test_entries_owned_by_another_user_are_refused(tmp_path):
    compile_once(tmp_path)
    with owned_by_someone_else(only_entry(tmp_path)), one_cache_warning(r"owned by uid \d+, not you"):
        assert compile_once(tmp_path)[0].cache == "miss"
    with owned_by_someone_else(os.path.join(only_entry(tmp_path), "compiled.py")), \
            one_cache_warning(r"compiled.py is owned by uid \d+, not you"):
        assert compile_once(tmp_path)[0].cache == "miss"
    with owned_by_someone_else(tmp_path), one_cache_warning(r"owned by uid \d+, not you.*without the cache"):
        assert compile_once(tmp_path)[0].cache == "bypass"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_an_entry_really_chowned_to_another_user_is_refused(tmp_path):
    compile_once(tmp_path)
    os.chown(only_entry(tmp_path), 12345, 12345)
    with one_cache_warning("owned by uid 12345, not you"):
        assert compile_once(tmp_path)[0].cache == "miss"


def test_linked_entries_and_files_are_refused(tmp_path):
    """A link to a valid entry (tag and all) is still refused: nothing in the cache is reached through a link."""
    compile_once(tmp_path / "cache")
    folder = only_entry(tmp_path / "cache")
    shutil.copytree(folder, tmp_path / "copy")
    shutil.rmtree(folder)
    os.symlink(tmp_path / "copy", folder)
    with one_cache_warning("is a symbolic link"):
        assert compile_once(tmp_path / "cache")[0].cache == "miss"
    folder = only_entry(tmp_path / "cache")
    os.replace(os.path.join(folder, "compiled.py"), tmp_path / "compiled.py")
    os.symlink(tmp_path / "compiled.py", os.path.join(folder, "compiled.py"))
    with one_cache_warning("compiled.py is a symbolic link"):
        assert compile_once(tmp_path / "cache")[0].cache == "miss"


def test_a_key_others_can_read_turns_the_cache_off(tmp_path):
    compile_once(tmp_path / "cache")
    key_file = os.environ["ASCEND_DSA_KEY_FILE"]
    os.chmod(key_file, 0o644)
    with one_cache_warning(re.escape(f"not using the cache key: {key_file} is readable or writable by group or "
                                     f"others (mode 0644): run chmod 600 {key_file}; compiling without the cache")):
        report, _ = compile_once(tmp_path / "cache")
    assert report.cache == "bypass"

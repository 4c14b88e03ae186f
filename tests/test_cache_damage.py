"""Damaged, cluttered and read-only caches never cost the compiled model: hits are served where they can be,
every other graph is compiled (never run eagerly), with at most one warning per problem."""
import errno
import os
import warnings

import pytest
import torch
from cache_helpers import compile_once, isolated_key, one_cache_warning, read_only

from npu_graph.cache import disk_store as disk_cache
from npu_graph.cache import entry as cache_entry
from npu_graph.cache.disk_store import CacheWarning, DiskCache

own_key = isolated_key()


def other_input():
    return torch.randn(6, 16)


@pytest.fixture
def filled(tmp_path):
    """A cache holding one entry (Net on a [4, 16] input)."""
    compile_once(tmp_path / "cache")
    return tmp_path / "cache"


def test_stray_files_in_entries_are_ignored(filled):
    entries = filled / "v2" / "entries"
    (entries / ".DS_Store").write_bytes(b"\0\1")
    (entries / "notes").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        assert compile_once(filled)[0].cache == "hit"
        assert compile_once(filled, x=other_input())[0].cache == "miss"  # stores, then prunes
    disk = DiskCache(str(filled))
    assert len(disk.entry_keys()) == 2 and disk.unknown_names() == [".DS_Store", "notes"]
    assert disk.stats()["entries"] == 2 and disk.prune(max_size=0)["left"] == {}


def test_a_read_only_cache_serves_hits_silently(filled):
    with read_only(filled), warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        report, _ = compile_once(filled)
    assert report.cache == "hit"


def test_a_read_only_cache_compiles_misses_with_one_warning(filled):
    with read_only(filled), one_cache_warning("cannot be written .*; cached graphs are still used, graphs compiled "
                                              "now are not stored"):
        report, _ = compile_once(filled, x=other_input())
    assert report.cache == "miss"
    assert len(DiskCache(str(filled)).entry_keys()) == 1


def test_a_read_only_folder_without_a_cache_is_skipped(tmp_path):
    (tmp_path / "cache").mkdir(mode=0o700)
    with read_only(tmp_path / "cache"), one_cache_warning("cannot use .*cache.*; compiling without the cache"):
        report, _ = compile_once(tmp_path / "cache")
    assert report.cache == "bypass"
    assert os.listdir(tmp_path / "cache") == []


def test_a_damaged_entry_in_a_read_only_cache_is_left_and_recompiled(filled):
    disk = DiskCache(str(filled))
    with open(os.path.join(disk.entry_dir(disk.entry_keys()[0]), "tag"), "w") as f:
        f.write("0" * 64)
    with read_only(filled), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report, _ = compile_once(filled)
    said = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert report.cache == "miss" and len(said) == 2
    assert "left in place, recompiling" in said[0] and "cannot be written" in said[1]


def test_a_full_disk_while_storing_costs_only_the_entry(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_cache, "write_entry", full)
    with one_cache_warning("No space left on device"):
        report, _ = compile_once(tmp_path)
    assert report.cache == "miss"
    disk = DiskCache(str(tmp_path))
    assert disk.entry_keys() == [] and os.listdir(os.path.join(disk.base, "tmp")) == []
    assert disk.stats().get("stores", 0) == 0


def test_an_entry_that_cannot_be_loaded_is_recompiled(filled, monkeypatch):
    def broken(self, name):
        raise RuntimeError("bound to a kernel this process lacks")

    monkeypatch.setattr(cache_entry.Artifact, "load", broken)
    with one_cache_warning("cannot be loaded .*bound to a kernel this process lacks.*recompiling"):
        assert compile_once(filled)[0].cache == "miss"


@pytest.mark.parametrize("damage", ["no meta", "no source", "extra file", "file for folder", "bad constants"])
def test_damaged_entries_are_quarantined_and_recompiled(filled, damage):
    disk = DiskCache(str(filled))
    (key,) = disk.entry_keys()
    folder = disk.entry_dir(key)
    if damage == "no meta":
        os.unlink(os.path.join(folder, "meta.json"))
    elif damage == "no source":
        os.unlink(os.path.join(folder, "compiled.py"))
    elif damage == "extra file":
        os.rename(os.path.join(folder, "constants.safetensors"), os.path.join(folder, "other"))
    elif damage == "file for folder":
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
        with open(folder, "w") as f:
            f.write("junk")
    else:
        with open(os.path.join(folder, "constants.safetensors"), "r+b") as f:
            f.write(b"\xff" * 16)
    with one_cache_warning(f"entry {key[:12]} is not used: .*moved to quarantine, recompiling"):
        assert compile_once(filled)[0].cache == "miss"
    assert compile_once(filled)[0].cache == "hit"

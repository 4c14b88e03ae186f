"""The compile cache and the dumps against their surroundings: where the cache lives (XDG_CACHE_HOME) and a full
disk (one warning, compilation goes on). Waiting for another process's entry: tests/test_cache_lease.py."""
import errno
import logging
import os

import torch
from cache_helpers import Net, compile_once, isolated_key, one_cache_warning

import npu_graph
from npu_graph.cache import folder as cache_folder
from npu_graph.cache.disk_store import DiskCache, default_root
from npu_graph.observe import dump as dump_module

own_key = isolated_key()
KEY = "ab" * 32


def test_the_cache_lives_under_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("ASCEND_DSA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root() == str(tmp_path / "xdg" / "ascend_dsa")
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({}))
    assert backend.cache.disk.root == str(tmp_path / "xdg" / "ascend_dsa")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec: ignore a relative value
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_root() == str(tmp_path / "home" / ".cache" / "ascend_dsa")
    monkeypatch.setenv("ASCEND_DSA_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_root() == str(tmp_path / "explicit")


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_storing_warns_once_and_graphs_still_compile(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_folder, "_write_private", disk_full)
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache_dir": str(tmp_path)}))
    model = Net()
    with one_cache_warning(r"the disk holding .* is full \(No space left on device\); cached graphs are still "
                           r"used, graphs compiled now are not stored"), torch.no_grad():
        for rows in (4, 5):  # two graphs: the second one says nothing more
            x = torch.randn(rows, 16)
            torch.testing.assert_close(torch.compile(model, backend=backend, dynamic=False)(x), model(x))
    assert [r.cache for r in backend.reports] == ["miss", "miss"] and all(r.fallback is None for r in backend.reports)
    assert DiskCache(str(tmp_path)).entry_keys() == []


def test_a_full_disk_while_dumping_warns_once_and_graphs_still_compile(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(dump_module, "_full_roots", set())
    real_open = open

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).startswith(str(tmp_path / "dump")):
            disk_full()
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(dump_module, "open", open_on_a_full_disk, raising=False)
    with caplog.at_level(logging.WARNING, logger="npu_graph"):
        compile_once(tmp_path / "cache", dump_dir=str(tmp_path / "dump"))
        compile_once(tmp_path / "cache", x=torch.randn(5, 16), dump_dir=str(tmp_path / "dump"))
    said = [r.getMessage() for r in caplog.records if r.name == "npu_graph"]
    assert len(said) == 1 and "is full (No space left on device); no more dumps are written there" in said[0]
    assert not any(r.exc_info for r in caplog.records)
    assert len(list((tmp_path / "dump").iterdir())) == 1  # the second graph made no folder

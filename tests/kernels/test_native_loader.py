"""kernels/native/loader.py: build at first use into the cache folder, reuse without rebuilding, one clear fallback
(switched off, no compiler, failing compiler), one build for processes starting together, and the library sharing
torch's OpenMP runtime."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from npu_graph.kernels.native import cpu_isa
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import trust as native_trust

SOURCE = "sparse_attention"


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache folder and no library loaded by this process yet (restored afterwards)."""
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    native._load.cache_clear()
    native._warn_no_compiler.cache_clear()
    yield tmp_path
    native._load.cache_clear()


def test_switched_off(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    loaded = native.load(SOURCE)
    assert not loaded and loaded.lib is None and "ASCEND_DSA_NATIVE=0" in loaded.reason


def test_no_compiler(fresh, monkeypatch):
    monkeypatch.delenv(native.ENV_CC, raising=False)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.warns(native.NativeLibraryWarning, match="no C compiler found") as caught:
        ok, reason = native.available(SOURCE)
        assert not native.available("rms_norm")[0]
    assert not ok and "no C compiler found" in reason and native.ENV_CC in reason
    assert len(caught) == 1                     # one warning per process, not one per kernel


@pytest.mark.parametrize("cc,message", [("false", "failed to build"),
                                        ("/nonexistent/cc", "could not run the C compiler")])
def test_failing_compiler_falls_back(fresh, monkeypatch, cc, message):
    monkeypatch.setenv(native.ENV_CC, cc)
    with pytest.warns(native.NativeLibraryWarning, match=message) as caught:
        ok, reason = native.available(SOURCE)
    assert not ok and message in reason and cc in reason
    assert len(caught) == 1 and SOURCE in str(caught[0].message)
    assert list(fresh.iterdir()) == []          # no library and no temporary file left behind


def test_built_once_then_reused(fresh, monkeypatch):
    if native.compiler() is None:
        pytest.skip("no C compiler")
    first = native.load(SOURCE)
    assert first, first.reason
    path = Path(first.reason)
    assert path.parent == fresh and path.exists() and path.name.startswith(f"{SOURCE}-{cpu_isa.active()}-")
    assert sorted(p.name for p in fresh.iterdir()) == [path.name, path.name + native_trust.RECORD_SUFFIX]
    native._load.cache_clear()

    def no_build(*args):
        raise AssertionError("a cached library was rebuilt")

    monkeypatch.setattr(native, "_build", no_build)
    assert native.load(SOURCE).reason == str(path)


def test_cache_key_follows_source_compiler_and_level(monkeypatch):
    cc = native.compiler() or "cc"
    before = native.library_path(SOURCE, cc, "generic")
    assert native.library_path(SOURCE, cc, "generic") == before
    assert native.library_path(SOURCE, cc + "-other", "generic") != before
    if cpu_isa.is_x86():
        assert len({native.library_path(SOURCE, cc, level) for level in cpu_isa.LEVELS}) == len(cpu_isa.LEVELS)
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-DOTHER"))
    assert native.library_path(SOURCE, cc, "generic") != before


def test_cache_key_follows_the_headers(monkeypatch, tmp_path):
    """A header the sources include is part of the key: editing it must not load a stale library."""
    (tmp_path / f"{SOURCE}.c").write_bytes((native.SOURCE_DIR / f"{SOURCE}.c").read_bytes())
    (tmp_path / "shared.h").write_text("#define X 1\n")
    monkeypatch.setattr(native, "SOURCE_DIR", tmp_path)
    before = native.library_path(SOURCE, "cc", "generic")
    (tmp_path / "shared.h").write_text("#define X 2\n")
    assert native.library_path(SOURCE, "cc", "generic") != before


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(native.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert native.cache_dir() == tmp_path / "ascend_dsa" / "native"
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path / "mine"))
    assert native.cache_dir() == tmp_path / "mine"


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc")
def test_one_openmp_runtime():
    """The native library uses the libgomp torch loaded, not a second copy with its own thread pool."""
    if not native.load(SOURCE):
        pytest.skip(native.load(SOURCE).reason)
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


def test_extra_flags_are_part_of_the_key(monkeypatch):
    """ASCEND_DSA_NATIVE_CFLAGS (the sanitizer build's flags) builds and loads a library of its own."""
    monkeypatch.delenv(native.ENV_CFLAGS, raising=False)
    plain = native.library_path(SOURCE, "cc", "generic")
    monkeypatch.setenv(native.ENV_CFLAGS, "-fsanitize=address")
    assert "-fsanitize=address" in native.level_flags("generic")
    assert native.library_path(SOURCE, "cc", "generic") != plain


def test_processes_starting_together_build_a_library_once(fresh, tmp_path):
    """Two processes on an empty folder load the same kernel while its build takes seconds (a compiler that waits
    2 s first): one builds it, the other waits for that build (its lease) and loads the result."""
    log = tmp_path / "builds"
    slow_cc = tmp_path / "slow_cc"
    slow_cc.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\nsleep 2\nexec {native.compiler()} \"$@\"\n")
    slow_cc.chmod(0o700)
    program = "from npu_graph.kernels.native import loader; assert loader.load('rms_norm').lib is not None"
    env = dict(os.environ, **{native.ENV_CC: str(slow_cc)})
    procs = [subprocess.Popen([sys.executable, "-c", program], env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    assert len(log.read_text().splitlines()) == 1
    assert any("waiting for process" in err and "building native kernel rms_norm" in err for err in errors)

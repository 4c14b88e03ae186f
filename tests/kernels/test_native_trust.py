"""kernels/native/trust.py through kernels/native/loader.py: a library planted under the expected name, one edited after
it was built, one whose build record carries another key's tag, or a linked one is refused with one warning and
rebuilt, and its code never runs; a build folder that others can write or that another user owns is refused and
the ops keep their torch paths."""
import os
import subprocess
import warnings

import pytest

from npu_graph.cache import trust
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import trust as native_trust

SOURCE = "rms_norm"
PAYLOAD = """
#include <stdio.h>
__attribute__((constructor)) static void payload(void) { FILE *f = fopen("%s", "w"); if (f) fclose(f); }
int rn_has_f16(void) { return 0; }
"""
pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


@pytest.fixture
def folder(monkeypatch, tmp_path):
    """An empty private build folder and no library loaded by this process yet (restored afterwards)."""
    build = tmp_path / "native"
    monkeypatch.setenv(native.ENV_DIR, str(build))
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    native._load.cache_clear()
    yield build
    native._load.cache_clear()


def expected_path() -> str:
    from npu_graph.kernels.native import cpu_isa
    return str(native.library_path(SOURCE, native.compiler(), cpu_isa.active()))


def plant(path: str, tmp_path, marker) -> None:
    """A shared library with a constructor that touches `marker` when it is loaded, at `path`."""
    source = tmp_path / "payload.c"
    source.write_text(PAYLOAD % marker)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    subprocess.run([native.compiler(), "-shared", "-fPIC", "-o", path, str(source)], check=True)


def load_with_one_warning(match: str) -> native.Native:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = native.load(SOURCE)
    said = [str(w.message) for w in caught if issubclass(w.category, native.NativeLibraryWarning)]
    assert len(said) == 1 and match in said[0], said
    return loaded


def test_a_planted_library_never_runs(folder, tmp_path):
    marker = tmp_path / "payload_ran"
    plant(expected_path(), tmp_path, marker)
    loaded = load_with_one_warning("it has no build record")
    assert loaded and not marker.exists()
    assert native_trust.open_verified(folder / os.path.basename(expected_path()))[0] is not None


def test_a_planted_library_with_a_copied_record_never_runs(folder, tmp_path):
    """A record taken from a genuine build does not vouch for other bytes."""
    assert native.load(SOURCE)
    path = expected_path()
    marker = tmp_path / "payload_ran"
    record = native_trust.record_path(native.Path(path)).read_bytes()
    plant(path, tmp_path, marker)
    native_trust.record_path(native.Path(path)).write_bytes(record)
    native._load.cache_clear()
    assert load_with_one_warning("its bytes differ") and not marker.exists()


def test_a_record_tagged_under_another_key_is_refused(folder, tmp_path, monkeypatch):
    assert native.load(SOURCE)
    path = native.Path(expected_path())
    digest = native_trust.hashlib.sha256(path.read_bytes()).hexdigest()
    other = trust.tag(native_trust._statement(path, digest), b"k" * 32)
    native_trust.record_path(path).write_text(f"{digest} {other}\n")
    native._load.cache_clear()
    assert load_with_one_warning("does not carry this user's tag")


def test_a_linked_library_is_refused(folder, tmp_path):
    """Even a link to the genuine bytes, with the genuine record: the loader follows no links."""
    assert native.load(SOURCE)
    path = expected_path()
    os.replace(path, tmp_path / "elsewhere.so")
    os.symlink(tmp_path / "elsewhere.so", path)
    native._load.cache_clear()
    assert load_with_one_warning("symbolic link")
    assert not os.path.islink(path)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_folder_others_can_write_is_refused(folder, mode):
    os.makedirs(folder, mode=0o700)
    os.chmod(folder, mode)
    loaded = load_with_one_warning("writable by group or others")
    assert not loaded and "untrusted native build folder" in loaded.reason
    assert os.listdir(folder) == []


def test_a_folder_another_user_owns_is_refused(folder, monkeypatch):
    os.makedirs(folder, mode=0o700)
    someone_else = os.getuid() + 1
    monkeypatch.setattr(trust.os, "getuid", lambda: someone_else)
    assert not load_with_one_warning("not you")


def test_new_folders_are_private(folder):
    assert native.load(SOURCE)
    assert os.stat(folder).st_mode & 0o777 == 0o700
    library = native.Path(expected_path())
    assert native_trust.record_path(library).exists() and os.stat(library).st_mode & 0o022 == 0


def test_several_libraries_load_side_by_side(folder):
    """Each library is loaded from its own verified descriptor, never confused with another one."""
    loaded = {name: native.load(name) for name in ("rms_norm", "attn_res", "rotary_mul", "causal_lengths")}
    assert all(loaded.values())
    assert loaded["rms_norm"].lib.rn_rows and loaded["attn_res"].lib.ar_rows and loaded["rotary_mul"].lib.ro_apply
    assert loaded["causal_lengths"].lib.cl_lengths

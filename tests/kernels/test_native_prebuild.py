"""kernels/native/prebuild.py and native.build_once: libraries built ahead on a thread, a graph's libraries two at a
time, and never one library built twice by two threads of a process."""
import threading
import time

import pytest

from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import prebuild as native_prebuild

SMALL = ("causal_lengths", "moe_gating")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache folder, no library loaded yet, builds counted per library, the prebuild not yet started."""
    if native.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    monkeypatch.setattr(native_prebuild, "_STARTED", threading.Event())
    monkeypatch.setattr(native_prebuild, "_AHEAD_STOP", threading.Event())
    native._load.cache_clear()
    builds: list[str] = []
    real = native._build

    def counted(source, target, cc, level):
        builds.append(source.stem)
        time.sleep(0.2)            # a slow compiler: the threads overlap
        return real(source, target, cc, level)
    monkeypatch.setattr(native, "_build", counted)
    yield builds
    native._load.cache_clear()


def test_build_now_builds_each_missing_library_once(fresh):
    native_prebuild.build_now([*SMALL, SMALL[0]])
    assert sorted(fresh) == sorted(SMALL)
    for name in SMALL:
        assert native.load(name), name
    assert sorted(fresh) == sorted(SMALL)        # load found them built
    native_prebuild.build_now(list(SMALL))
    assert sorted(fresh) == sorted(SMALL)


def test_load_waits_for_the_build_in_flight(fresh):
    cc, level, todo = native_prebuild._missing(SMALL[:1])
    other = threading.Thread(target=native.build_unless_busy, args=(*todo[0], cc, level))
    other.start()
    while not fresh:
        time.sleep(0.01)
    assert native.load(SMALL[0])                 # waited for the other thread's build instead of its own
    other.join()
    assert fresh == [SMALL[0]]


def test_ahead_builds_in_order_until_the_compile_ends(fresh, monkeypatch):
    monkeypatch.setattr(native_prebuild, "ORDER", (*SMALL, "rotary_mul", "rms_norm", "skinny_mm"))
    with native_prebuild.building_ahead():
        while len(fresh) < 2:
            time.sleep(0.01)
    time.sleep(1.0)
    assert fresh[:2] == list(SMALL) and len(fresh) <= 3    # stopped: at most the build under way finished
    with native_prebuild.building_ahead():                  # once a process
        time.sleep(0.3)
    assert len(fresh) <= 3


def test_switched_off_builds_nothing(fresh, monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    with native_prebuild.building_ahead():
        native_prebuild.build_now(list(SMALL))
    time.sleep(0.3)
    assert fresh == []


def test_a_graph_s_needs_stop_the_guesses(fresh, monkeypatch):
    monkeypatch.setattr(native_prebuild, "ORDER", ("rotary_mul", "rms_norm", "skinny_mm", "fused_moe"))
    with native_prebuild.building_ahead():
        while not fresh:
            time.sleep(0.01)
        native_prebuild.build_now(list(SMALL))
        time.sleep(1.0)
    assert sorted(fresh[1:]) == sorted(SMALL)    # the guess under way finished, no other started


def test_a_folder_it_cannot_use_is_left_to_load_to_report(fresh, monkeypatch):
    def refuse(path):
        raise native_prebuild.trust.UntrustedPath(f"{path} is writable by others")
    monkeypatch.setattr(native_prebuild.trust, "ensure_private_dir", refuse)
    native_prebuild.build_now(list(SMALL))                  # no exception: the compile goes on
    with native_prebuild.building_ahead():
        pass
    assert fresh == []


def test_resolving_the_backend_by_name_starts_the_builds_and_a_compiles_end_stops_them(fresh):
    """torch resolves `ascend_dsa` through npu_graph.backend_entry before Dynamo traces: the libraries start
    building then; the first compile's end stops the guesses though another caller started them."""
    import npu_graph.backend_entry as entry
    from npu_graph.backend import ascend_dsa
    assert not native_prebuild._STARTED.is_set()
    assert entry.ascend_dsa is ascend_dsa
    assert native_prebuild._STARTED.is_set() and not native_prebuild._AHEAD_STOP.is_set()
    with native_prebuild.building_ahead():
        pass
    assert native_prebuild._AHEAD_STOP.is_set()
    with pytest.raises(AttributeError, match="has no attribute 'other'"):
        entry.other  # noqa: B018


def test_the_entry_point_names_the_module_that_starts_the_builds(monkeypatch):
    from importlib.metadata import entry_points
    monkeypatch.setenv(native.ENV_SWITCH, "0")     # resolved here without starting builds in the test process
    (point,) = [p for p in entry_points(group="torch_dynamo_backends") if p.name == "ascend_dsa"]
    assert point.value == "npu_graph.backend_entry:ascend_dsa"
    from npu_graph.backend import ascend_dsa
    assert point.load() is ascend_dsa

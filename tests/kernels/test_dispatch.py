"""kernels/native/dispatch.py: the faster path is measured once per shape class and level, remembered in memory and on
disk, and taken from then on; ASCEND_DSA_NATIVE=1 forces the native kernels, =0 switches them off; the fused ops
go through it and give the same results whichever path it picks."""
import json
import time

import pytest
import torch

from npu_graph.kernels.native import call_plans, dispatch
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.rowwise.rms_norm import reference_rms_norm


@pytest.fixture
def table(dispatch_table):
    """Measured dispatch with an empty table kept in tmp_path (conftest's `dispatch_table`)."""
    return dispatch_table


def counting(result, seconds: float, calls: list):
    def fn():
        calls.append(result)
        time.sleep(seconds)
        return result
    return fn


@pytest.mark.parametrize(("value", "mode"), [("auto", "auto"), (None, "auto"), ("1", "force"), ("0", "off")])
def test_modes(value, mode, monkeypatch):
    if value is None:
        monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(native.ENV_SWITCH, value)
    assert dispatch.mode() == mode


def test_shape_classes_bucket_sizes():
    assert [dispatch.bucket(n) for n in (0, 1, 2, 3, 5, 64, 65, 16384)] == [0, 1, 2, 4, 8, 64, 128, 16384]
    assert dispatch.shape_class(torch.bfloat16, 3, True) == ("torch.bfloat16", 4, "True")
    assert dispatch.shape_class(1000) == dispatch.shape_class(1024) != dispatch.shape_class(1025)


@pytest.mark.parametrize(("native_s", "torch_s", "winner"), [(0.004, 0.0, "torch"), (0.0, 0.004, "native")])
def test_the_faster_path_is_measured_then_kept(table, native_s, torch_s, winner):
    calls: list = []
    native_fn, torch_fn = counting("native", native_s, calls), counting("torch", torch_s, calls)
    assert dispatch.run("op", "rms_norm", ("a",), native_fn, torch_fn) == winner
    assert {"native", "torch"} <= set(calls) and len(calls) >= 4          # a warm-up round, then timed rounds
    calls.clear()
    for _ in range(3):
        assert dispatch.run("op", "rms_norm", ("a",), native_fn, torch_fn) == winner
    assert calls == [winner] * 3
    choice = dispatch.lookup("op", "rms_norm", ("a",))
    assert choice.impl == winner and (choice.native_ms < choice.torch_ms) == (winner == "native")
    saved = json.loads(table.read_text())
    assert len(saved) == 1 and next(iter(saved.values()))["impl"] == winner
    assert table.stat().st_mode & 0o077 == 0


def test_a_choice_is_per_thread_count(table, torch_threads):
    """A class measured on one thread count is measured again on another (a path that wins on 2 threads can lose
    on 16), and each count keeps its own choice, in memory and on disk."""
    calls: list = []
    torch_threads(1)
    assert dispatch.run("op", "rms_norm", ("a",), counting("native", 0.001, calls),
                        counting("torch", 0.004, calls)) == "native"
    torch_threads(2)
    calls.clear()
    assert dispatch.run("op", "rms_norm", ("a",), counting("native", 0.004, calls),
                        counting("torch", 0.001, calls)) == "torch"
    assert {"native", "torch"} <= set(calls)                 # measured, not taken from the 1-thread choice
    torch_threads(1)
    assert dispatch.lookup("op", "rms_norm", ("a",)).impl == "native"
    assert sorted(c["impl"] for c in json.loads(table.read_text()).values()) == ["native", "torch"]


def test_a_close_first_measurement_is_provisional_then_measured_again(table, monkeypatch):
    """Paths within CLOSE: the first choice serves the class for REMEASURE_S without being kept (a busy machine at
    first use), then one more measurement decides and is kept, close or not."""
    calls: list = []
    native_fn, torch_fn = counting("native", 0.002, calls), counting("torch", 0.002, calls)
    first = dispatch.run("op", "rms_norm", ("p",), native_fn, torch_fn)
    assert not table.exists() and dispatch.known("op", ("p",)) == first     # plans may use it until it expires
    assert dispatch.describe("op", "rms_norm", ("p",))["why"].startswith("provisional")
    calls.clear()
    assert dispatch.run("op", "rms_norm", ("p",), native_fn, torch_fn) == first and calls == [first]
    monkeypatch.setattr(time, "monotonic", lambda: float("inf"))             # REMEASURE_S later
    calls.clear()
    second = dispatch.run("op", "rms_norm", ("p",), native_fn, torch_fn)
    assert len(calls) >= 4 and dispatch.known("op", ("p",)) == second
    assert next(iter(json.loads(table.read_text()).values()))["impl"] == second


def test_long_paths_are_timed_by_one_call_each_and_kept(table, monkeypatch):
    """Paths that take over LONG_S together (a prefill-sized call) run once each, the warm-up round deciding, and
    the choice is kept at once even when close: timing them over the minimum rounds cost minutes in a first call."""
    monkeypatch.setattr(dispatch, "LONG_S", 0.01)
    calls: list = []
    native_fn, torch_fn = counting("native", 0.008, calls), counting("torch", 0.006, calls)
    assert dispatch.run("op", "rms_norm", ("l",), native_fn, torch_fn) == "torch"
    assert sorted(calls) == ["native", "torch"]
    choice = dispatch.lookup("op", "rms_norm", ("l",))
    assert choice.impl == "torch" and choice.torch_ms >= 6 and choice.native_ms >= 8
    calls.clear()
    assert dispatch.run("op", "rms_norm", ("l",), native_fn, torch_fn) == "torch" and calls == ["torch"]


def test_a_probe_is_measured_in_place_of_the_call(table):
    """With a probe, the dispatch times the probe's pair and runs only the chosen full path, once."""
    calls: list = []
    probe = counting("native probe", 0.0, calls), counting("torch probe", 0.004, calls)
    assert dispatch.run("op", "rms_norm", ("q",), counting("native", 0.0, calls), counting("torch", 0.0, calls),
                        probe=probe) == "native"
    assert calls.count("native") == 1 and "torch" not in calls and len(calls) >= 5
    assert dispatch.lookup("op", "rms_norm", ("q",)).torch_ms >= 4


def test_plans_made_from_a_provisional_choice_are_forgotten_when_it_expires(table, monkeypatch):
    """An op stores a plan from a provisional choice (its calls are one lookup meanwhile); when the choice expires
    every plan is forgotten, so the next call takes the full path and measures the class again."""
    plans = call_plans.Plans("op")
    calls: list = []
    dispatch.run("op", "rms_norm", ("p",), counting("native", 0.002, calls), counting("torch", 0.002, calls))
    plans.put("signature", lambda: dispatch.known("op", ("p",)))
    assert plans.get("signature") is not None
    monkeypatch.setattr(time, "monotonic", lambda: float("inf"))             # REMEASURE_S later
    assert plans.get("signature") is None and dispatch.known("op", ("p",)) is None and not call_plans._CLEAR_AT


def test_a_later_process_starts_from_the_table(table, monkeypatch):
    calls: list = []
    dispatch.run("op", "rms_norm", ("b",), counting("native", 0.0, calls), counting("torch", 0.004, calls))
    monkeypatch.setattr(dispatch, "_table", None)          # what a new process sees
    monkeypatch.setattr(dispatch, "_known", {})
    calls.clear()
    dispatch.run("op", "rms_norm", ("b",), counting("native", 0.0, calls), counting("torch", 0.0, calls))
    assert calls == ["native"]


def test_a_damaged_table_is_measured_again(table):
    table.write_text("{not json")
    calls: list = []
    assert dispatch.run("op", "rms_norm", ("c",), counting("n", 0.0, calls), counting("t", 0.004, calls)) == "n"
    assert json.loads(table.read_text())


def test_forced_native_never_runs_the_torch_path(table, monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    calls: list = []
    assert dispatch.run("op", "rms_norm", ("d",), counting("native", 0.0, calls), counting("t", 0.0, calls)) \
        == "native"
    assert calls == ["native"] and not table.exists()


def test_torch_path_switches_native_off_for_the_call():
    seen = []
    dispatch.torch_path(lambda: seen.append(bool(native.load("rms_norm"))))()
    assert seen == [False] and (native.load("rms_norm") or native.compiler() is None)


@pytest.mark.skipif(not native.available("rms_norm")[0], reason="no native kernels built")
def test_ops_go_through_dispatch(table, monkeypatch):
    monkeypatch.setattr(dispatch, "CLOSE", 1.0)         # the first measurement decides, however close
    x, gamma = torch.randn(2, 512), torch.rand(512)
    for _ in range(2):
        y, _ = torch.ops.ascend_dsa.rms_norm(x, gamma, 1e-6)
        torch.testing.assert_close(y, reference_rms_norm(x, gamma, 1e-6)[0])
    saved = json.loads(table.read_text())
    (key,) = saved
    assert key.startswith("rms_norm|") and saved[key]["impl"] in ("native", "torch")
    described = dispatch.describe("rms_norm", "rms_norm", dispatch.shape_class(x.dtype, 2, 512))
    assert described["impl"] == saved[key]["impl"] and "measured: native" in described["why"]


def test_prepare_runs_before_every_timed_call_and_not_after_the_choice(table):
    calls: list = []
    prepared: list = []

    def prepare():
        prepared.append(len(calls))                     # the calls made so far: prepare comes before each one
    native_fn, torch_fn = counting("native", 0.0, calls), counting("torch", 0.001, calls)
    assert dispatch.run("op", "rms_norm", ("cold",), native_fn, torch_fn, prepare) == "native"
    assert prepared == list(range(len(calls)))
    dispatch.run("op", "rms_norm", ("cold",), native_fn, torch_fn, prepare)
    assert len(prepared) == len(calls) - 1              # a decided class runs its choice alone


def test_a_measurement_runs_outside_dispatch_modes(table):
    """AOT autograd runs a graph's first call under a TorchDispatchMode that sends every ATen call through Python:
    a measurement there would time the mode. The measurement's rounds run outside it (the mode sees none), and the
    choice is the faster path's: here the torch path, whose ATen calls the mode would slow."""
    class SlowMode(torch.utils._python_dispatch.TorchDispatchMode):
        seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            SlowMode.seen += 1
            time.sleep(0.002)
            return func(*args, **(kwargs or {}))

    x = torch.ones(4)
    with SlowMode():
        result = dispatch.run("op", "rms_norm", ("modes",), lambda: (time.sleep(0.001), "native")[1],
                              lambda: (x + 1, "torch")[1])
    assert result == "torch" and SlowMode.seen == 0
    assert dispatch.lookup("op", "rms_norm", ("modes",)).impl == "torch"

"""Settings that reach the backend are honoured or refused, never dropped: torch.compile's `mode=`, `options=`
given with a get_backend() object, `get_backend(compiler_config=...)`, and torchair's frozen_parameter."""
import time
import warnings

import pytest
import torch

import npu_graph
from npu_graph import CompilerConfig, ConfigError, get_backend
from npu_graph.backend import CompilationFallbackWarning, OptionsMergedWarning
from npu_graph.config import MODES
from npu_graph.runtime import compiled_graph as runtime
from npu_graph.runtime.autotune import MeasuredChoice


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    monkeypatch.setenv("ASCEND_DSA_DISABLE_CACHE", "1")


class Stacked(torch.nn.Module):
    """Parameter-only work (stack, cast, transpose) that the prologue hoists."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x @ torch.stack([self.a, self.b]).double().sum(0).float().t()


@pytest.fixture
def built_graphs(monkeypatch):
    """Every CompiledGraph built while the test runs."""
    graphs = []
    original = runtime.CompiledGraph.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        graphs.append(self)

    monkeypatch.setattr(runtime.CompiledGraph, "__init__", spy)
    return graphs


def test_unknown_mode_is_refused_with_its_name():
    model, x = torch.nn.Linear(8, 4), torch.randn(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompilationFallbackWarning)
        with pytest.raises(Exception, match="no-such-mode") as info:
            torch.compile(model, backend="ascend_dsa", mode="no-such-mode")(x)
    assert "mode" in str(info.value)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "default"])
def test_each_mode_reaches_the_backend_and_matches_eager(mode):
    torch.manual_seed(0)
    model, x = torch.nn.Linear(8, 4), torch.randn(2, 8)
    with torch.no_grad():
        out = torch.compile(model, backend="ascend_dsa", mode=mode)(x)
        torch.testing.assert_close(out, model(x))
    report = get_backend(CompilerConfig.from_options(mode=mode)).reports[-1]
    assert report.fallback is None and report.extra["runtime"]["mode"] == mode


@pytest.mark.filterwarnings("ignore::npu_graph.targets.npu.NpuProgramNotExecutedWarning")
@pytest.mark.parametrize("mode, torchair_mode", [("reduce-overhead", "reduce-overhead"), ("default", "max-autotune")])
def test_the_npu_program_runs_in_the_modes_torchair_graph_mode(mode, torchair_mode, tmp_path):
    model, x = torch.nn.Linear(8, 4), torch.randn(2, 8)
    backend = get_backend({"target": "npu", "mode": mode, "dump_dir": str(tmp_path)})
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    section = backend.reports[-1].extra["npu_program"]
    assert section["torchair_mode"] == torchair_mode
    program = (tmp_path / backend.reports[-1].dump_folder / "npu_program_torchair.py").read_text()
    assert ('config.mode = "reduce-overhead"' in program) == (mode == "reduce-overhead")


def test_mode_with_a_backend_object_compiles_under_that_mode():
    backend = get_backend({"streams": 2})
    derived = get_backend({"streams": 2, "mode": "reduce-overhead"})
    before = len(backend.reports), len(derived.reports)   # equal configs share one backend across tests
    model, x = torch.nn.Linear(8, 4), torch.randn(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            torch.compile(model, backend=backend, mode="reduce-overhead")(x)
    assert (len(backend.reports), len(derived.reports)) == (before[0], before[1] + 1)
    assert derived.reports[-1].extra["runtime"]["mode"] == "reduce-overhead"


def test_options_with_a_backend_object_are_merged_with_one_warning():
    backend = get_backend({"streams": 2})
    merged = get_backend({"streams": 2, "superkernel": False})
    before = len(backend.reports), len(merged.reports)    # equal configs share one backend across tests
    model, x = torch.nn.Linear(8, 4), torch.randn(2, 8)
    with pytest.warns(OptionsMergedWarning, match="superkernel"), torch.no_grad():
        torch.compile(model, backend=backend, options={"superkernel": False})(x)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptionsMergedWarning)
        with torch.no_grad():
            torch.compile(model, backend=backend, options={"superkernel": False})(x)
    assert (len(backend.reports), len(merged.reports)) == (before[0], before[1] + 2)


def test_bad_options_with_a_backend_object_raise_instead_of_falling_back():
    model, x = torch.nn.Linear(8, 4), torch.randn(2, 8)
    with pytest.raises(Exception, match="streams"):
        torch.compile(model, backend=get_backend(), options={"streams": 0})(x)


def test_get_backend_takes_torchairs_compiler_config_keyword(monkeypatch):
    monkeypatch.delenv("ASCEND_DSA_CPU_GLUE", raising=False)   # the suite's default (conftest) is not an object's
    config = CompilerConfig()
    config.streams.count = 2
    backend = get_backend(compiler_config=config)
    assert backend is get_backend(config) and backend is get_backend({"streams": 2})
    config.streams.count = 1
    assert backend.config.streams.count == 2, "the backend keeps its own copy"
    with pytest.raises(ConfigError, match="once"):
        get_backend(config, compiler_config=config)
    with pytest.raises(ConfigError, match="CompilerConfig or a dict"):
        get_backend(compiler_config="npu")


@pytest.mark.parametrize("path, value, word", [("streams.count", 0, "streams"), ("mode", "fast", "fast"),
                                               ("experimental_config.frozen_parameter", "yes", "frozen_parameter"),
                                               ("cache.max_size", "2G", "max_size"), ("target", "gpu", "target")])
def test_a_compiler_config_object_is_validated_like_options(path, value, word):
    config = CompilerConfig()
    config.set(path, value)
    with pytest.raises(ConfigError, match=word):
        get_backend(compiler_config=config)


def compile_stacked(frozen, options=None):
    torch.manual_seed(0)
    model = Stacked()
    backend = get_backend({"frozen_parameter": frozen, **(options or {})})
    return model, torch.compile(model, backend=backend), backend


def test_frozen_parameters_are_read_once_and_never_checked_again(built_graphs, monkeypatch):
    versions_read = []
    stamp = runtime._stamp
    monkeypatch.setattr(runtime, "_stamp", lambda p: versions_read.append(p) or stamp(p))
    model, compiled, backend = compile_stacked(True)
    x = torch.randn(3, 8)
    with torch.no_grad():
        before = model(x)
        torch.testing.assert_close(compiled(x), before)
        read_by_first_call = len(versions_read)
        for _ in range(3):
            torch.testing.assert_close(compiled(x), before)
        model.a.mul_(2.0)       # the user's responsibility under frozen_parameter: the graph keeps the old values
        torch.testing.assert_close(compiled(x), before)
    (graph,) = built_graphs
    assert graph.frozen_parameters and graph.prologue_runs == 1
    assert read_by_first_call == 2 and len(versions_read) == 2, "no parameter checks after the first call"
    assert backend.reports[-1].extra["runtime"] == {"mode": "default", "prologue": True, "prologue_parameters": 2,
                                                    "frozen_parameters": True, "glue": "python",
                                                    "glue_reason": "option cpu.glue='python'"}


def test_without_frozen_parameters_an_update_is_seen(built_graphs):
    model, compiled, backend = compile_stacked(False)
    x = torch.randn(3, 8)
    with torch.no_grad():
        compiled(x)
        model.a.mul_(2.0)
        torch.testing.assert_close(compiled(x), model(x))
    assert built_graphs[0].prologue_runs == 2 and not built_graphs[0].frozen_parameters
    assert backend.reports[-1].extra["runtime"]["frozen_parameters"] is False


def test_frozen_parameters_survive_the_disk_cache(built_graphs, monkeypatch, tmp_path):
    monkeypatch.delenv("ASCEND_DSA_DISABLE_CACHE")
    x = torch.randn(3, 8)
    with torch.no_grad():
        compile_stacked(True, {"cache_dir": str(tmp_path)})[1](x)
        torch._dynamo.reset()
        model, compiled, backend = compile_stacked(True, {"cache_dir": str(tmp_path)})
        torch.testing.assert_close(compiled(x), model(x))
    assert backend.reports[-1].cache == "hit" and built_graphs[-1].frozen_parameters
    assert backend.reports[-1].extra["runtime"]["frozen_parameters"] is True


def test_frozen_parameters_with_dynamos_module_guards_skipped(built_graphs):
    torch.manual_seed(0)
    model, x = Stacked(), torch.randn(3, 8)
    options = {"frozen_parameter": True, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="ascend_dsa", options=options)(x), model(x))
    assert built_graphs[-1].frozen_parameters


def test_measured_choice_keeps_the_faster_candidate():
    bound = []

    def slow(v):
        time.sleep(0.002)
        return v + 1

    def broken(v):
        raise RuntimeError("no kernel")

    choice = MeasuredChoice("region", {"slow": slow, "fast": lambda v: v + 1, "broken": broken}, bound.append)
    with pytest.warns(RuntimeWarning, match="broken"):
        assert choice(1) == 2
    assert choice.choice == "fast" and bound[0](1) == 2 and set(choice.times_ms) == {"slow", "fast"}


def test_measured_choice_raises_when_the_reference_fails():
    def broken(v):
        raise RuntimeError("reference broke")

    with pytest.raises(RuntimeError, match="reference broke"):
        MeasuredChoice("region", {"python": broken, "other": lambda v: v}, lambda fn: None)(1)


@pytest.mark.slow
def test_max_autotune_measures_each_superkernel_region(built_graphs):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="ascend_dsa", mode="max-autotune")(x), model(x))
    report = get_backend(CompilerConfig.from_options(mode="max-autotune")).reports[-1]
    assert report.extra["superkernels"]["compiler"] == "measured" and report.extra["superkernels"]["count"] >= 1
    region = built_graphs[-1]._self.superkernel_0
    assert not isinstance(region, MeasuredChoice), "the first call bound the faster form"
    assert npu_graph.CompilerConfig(mode="reduce-overhead").superkernel_compiler() == "python"

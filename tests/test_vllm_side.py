"""Our side of serving under vLLM, without vLLM: value-type opaque inputs (vLLM's layer names) keyed by value, a
cache entry loaded by its key alone, the tiny serving checkpoints, the serving modes and the bench row."""
import pytest
import torch
from cache_helpers import isolated_key
from torch._library import opaque_object
from torch._opaque_base import OpaqueBase

from npu_graph.backend import Backend
from npu_graph.cache import key as cache_key
from npu_graph.cache.precompiled import PrecompiledGraph
from npu_graph.config import CompilerConfig
from npu_graph.tools.bench_serve import family_row
from npu_graph.vllm import checkpoints, plugin, serve_run

own_key = isolated_key()


class Name(OpaqueBase):
    """A value-type opaque object as vLLM's LayerName is."""

    def __init__(self, value: str):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Name) and self.value == other.value

    def __hash__(self):
        return hash(self.value)

    def __fx_repr__(self):
        return f"Name({self.value!r})", {"Name": Name}


opaque_object.register_opaque_type(Name, typ="value")


def test_a_value_opaque_input_is_keyed_by_its_value():
    first, again, other = (cache_key.opaque_constant(Name(n)) for n in ("layers.0.attn", "layers.0.attn", "x"))
    assert first == again != other
    assert "layers.0.attn" in first
    assert cache_key.input_metadata([Name("layers.0.attn")]) == [first]


def test_other_values_are_not_opaque_constants():
    assert cache_key.opaque_constant("layers.0.attn") is None
    assert cache_key.opaque_constant(torch.ones(1)) is None


def _compiled(cache_dir):
    """Compile a parameterless function through a cache at `cache_dir`; returns (the backend's result, eager)."""
    backend = Backend(CompilerConfig.from_options({"cache_dir": str(cache_dir)}))
    results = []

    def keep(gm, example_inputs):
        results.append(backend(gm, example_inputs))
        return results[-1]

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    fn = torch.compile(lambda t: (torch.relu(t) * 2.0).softmax(-1), backend=keep)
    fn(x)
    return results[0], x


def test_a_cache_entry_loads_by_its_key_without_tracing(tmp_path):
    compiled, x = _compiled(tmp_path)
    assert isinstance(compiled, PrecompiledGraph) and compiled.key
    fresh = Backend(CompilerConfig.from_options({"cache_dir": str(tmp_path)}))
    loaded = fresh.cache.load_entry(compiled.key, compiled.name)
    assert loaded is not None and loaded.key == compiled.key and loaded.artifact is not None
    torch.testing.assert_close(loaded.callable(x)[0], (torch.relu(x) * 2.0).softmax(-1))
    assert fresh.cache.load_entry("0" * 64, "graph_9") is None


def test_the_checkpoint_families_are_built_from_configs(tmp_path):
    folder = checkpoints.build_checkpoint("llama", str(tmp_path / "llama"))
    assert (tmp_path / "llama" / "config.json").exists() and folder == str(tmp_path / "llama")
    assert checkpoints.family_config("qwen3_moe").num_experts == 8
    with pytest.raises(ValueError, match="family='gpt2'"):
        checkpoints.family_config("gpt2")
    assert checkpoints.prompts(4) == checkpoints.prompts(4) and len(checkpoints.prompts(16)) == 16


def test_serving_modes_are_configuration_only():
    assert serve_run.llm_options("eager", "m", 4)["enforce_eager"] is True
    assert serve_run.llm_options("ascend_dsa", "m", 4)["compilation_config"] == {"backend": "ascend_dsa"}
    assert "compilation_config" not in serve_run.llm_options("default", "m", 4)
    custom = ["+rms_norm", "+silu_and_mul"]
    assert serve_run.llm_options("ascend_dsa", "m", 4, custom)["compilation_config"] == {
        "backend": "ascend_dsa", "custom_ops": custom}
    assert serve_run.llm_options("default", "m", 4, custom)["compilation_config"] == {"custom_ops": custom}
    assert "compilation_config" not in serve_run.llm_options("eager", "m", 4, custom)
    with pytest.raises(ValueError, match="mode='fast'"):
        serve_run.llm_options("fast", "m", 4)


def test_only_configs_that_ask_for_ascend_dsa_are_taken():
    class Compilation:
        backend = "inductor"

    assert not plugin.asks_for_ascend_dsa(Compilation())
    Compilation.backend = "ascend_dsa"
    assert plugin.asks_for_ascend_dsa(Compilation())


def test_the_bench_row_takes_the_median_of_per_round_ratios():
    def run(tokens, tok_s, compile_s, compiled=0, loaded=0, ttft=0.1):
        return {"tokens": tokens, "throughput": tok_s, "ttft_s": ttft, "compile_s": compile_s, "init_s": 1.0,
                "graphs_compiled": compiled, "graphs_loaded": loaded}

    eager, cold = run([[1, 2]], 50, 0), run([[1, 2]], 90, 4, compiled=1)
    pairs = [(run([[1, 2]], 100, 0), run([[1, 2]], 120, 0.2, loaded=1)),      # ratio 1.2
             (run([[1, 2]], 400, 0), run([[1, 2]], 200, 0.1, loaded=1)),      # 0.5, a round under other load
             (run([[1, 2]], 200, 0), run([[1, 2]], 300, 0.3, loaded=1, ttft=0.2))]   # 1.5
    row = family_row("llama", eager, cold, pairs)
    assert row["tokens_equal"] and row["default_tokens_equal"] and row["backend_graphs"] == 1
    assert row["warm_graphs_loaded"] == 1 and row["warm_graphs_compiled"] == 0
    assert row["round_ratios"] == pytest.approx([1.2, 0.5, 1.5]) and row["throughput_ratio"] == pytest.approx(1.2)
    assert row["default_best_tok_s"] == 400 and row["ascend_dsa_best_tok_s"] == 300
    assert row["ttft_ratio"] == pytest.approx(1.0) and row["warm_compile_ratio"] == pytest.approx(0.3 / 4)
    row = family_row("llama", eager, cold, [*pairs, (run([[1, 2]], 100, 0), run([[1, 3]], 120, 0.2))])
    assert not row["tokens_equal"]

"""The ways users compile a tiny transformers model for generate() with backend="ascend_dsa": greedy tokens equal
eager's, every graph compiles (no eager fallback), and nothing compiles after the symbolic decode graph."""
import pytest
import torch

import npu_graph
from npu_graph.backend import Backend, CompilationFallbackWarning
from npu_graph.runtime import glue_upgrade

transformers = pytest.importorskip("transformers")

FAMILIES = ["deepseek_v32", "kimi_linear", "qwen3_moe", "llama"]
TOKENS = 32
LENGTHS = [12, 17, 9]  # one generate() per prompt length, in this order
# Graphs the backend compiles in each generate() of LENGTHS. Dynamo's automatic dynamic shapes (the same with
# backend="eager"): the first generate compiles the prefill (static length), the first decode step (static cache
# length), then one decode graph with a symbolic cache length that every later step reuses; the second prompt
# length recompiles the prefill with a symbolic length once; from then on nothing compiles.
COMPILES = {
    "forward": [3, 1, 0],  # model.forward = torch.compile(model.forward, ...)
    "module_compile": [3, 1, 0],  # model.compile(backend=...): nn.Module.__call__ runs the compiled forward
    "compile_config": [1, 0, 0],  # transformers compiles the decode step only (prefill runs eagerly), static cache
    "optimized_module": [0, 0, 0],  # torch.compile(model).generate is the original module's: nothing compiles
}
# The left-padded batch fails in the backend on DeepSeek-V3.2 (sparse attention with a [B, 1, S, K] mask).
@pytest.fixture
def compiles(monkeypatch):
    """One entry per call of the ascend_dsa backend during the test: the reports that call added. The disk cache
    is off, so every graph is compiled here rather than loaded from an earlier run."""
    monkeypatch.setenv("ASCEND_DSA_DISABLE_CACHE", "1")
    calls, original = [], Backend.__call__

    def counted(self, gm, example_inputs, **kwargs):
        before = len(self.reports)
        compiled = original(self, gm, example_inputs, **kwargs)
        calls.append(self.reports[before:])
        return compiled

    monkeypatch.setattr(Backend, "__call__", counted)
    return calls

# The fused indexer and sparse attention take per-row key lengths (right-down causal), not per-row start offsets:
# a left-padded row's mask hides keys at the start, causal_lengths refuses it at run time and the graph runs
# eagerly with one warning (tokens stay right). A batch of equal-length prompts, or a mask of ones, compiles.
DSA_LEFT_PADDING = ("left padding: the fused DSA ops take per-row key lengths, not start offsets, so the graph of "
                    "a left-padded batch runs eagerly (one warning)")


def prompt(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids)


def left_padded(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of prompts of `lengths`, pad_token_id 0 on the left, attention mask 0 there."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, ids.shape[1] - length:] = torch.randint(3, 256, (length,), generator=generator)
        mask[row, ids.shape[1] - length:] = 1
    return ids, mask


def greedy(generate, inputs: tuple[torch.Tensor, torch.Tensor], tokens: int, **kwargs) -> torch.Tensor:
    """Exactly `tokens` greedy tokens (eos suppressed, so every run takes the same number of decode steps)."""
    with torch.no_grad():
        out = generate(inputs[0], attention_mask=inputs[1], max_new_tokens=tokens, min_new_tokens=tokens,
                       do_sample=False, **kwargs)
    assert out.shape[1] == inputs[0].shape[1] + tokens
    return out


def static_cache(compiled: bool) -> dict:
    """generate() kwargs for transformers' own compilation: a static cache sized for every prompt here (so a
    longer prompt reuses it), and a CompileConfig; on CPU transformers compiles only with _compile_all_devices."""
    if not compiled:
        return {"cache_implementation": "static", "max_cache_len": 64, "disable_compile": True}
    config = transformers.CompileConfig(backend="ascend_dsa")
    config._compile_all_devices = True
    return {"cache_implementation": "static", "max_cache_len": 64, "compile_config": config}


def compile_for_generate(model: torch.nn.Module, idiom: str) -> tuple[object, dict]:
    """(the generate a user calls, its extra kwargs) after compiling `model` the way `idiom` does."""
    if idiom == "forward":
        model.forward = torch.compile(model.forward, backend="ascend_dsa")
        return model.generate, {}
    if idiom == "module_compile":
        model.compile(backend="ascend_dsa")
        return model.generate, {}
    if idiom == "optimized_module":
        return torch.compile(model, backend="ascend_dsa").generate, {}
    assert idiom == "compile_config"
    return model.generate, static_cache(compiled=True)


def assert_no_fallback(compiles: list, recwarn: pytest.WarningsRecorder) -> None:
    failed = [r.name + ": " + r.fallback for reports in compiles for r in reports if r.fallback]
    assert not failed, f"graphs that fell back to eager: {failed}"
    eager = [str(w.message) for w in recwarn if issubclass(w.category, CompilationFallbackWarning)]
    assert not eager, eager


def check_idiom(model: torch.nn.Module, idiom: str, inputs: list, tokens: int, compiles: list,
                recwarn: pytest.WarningsRecorder) -> list[int]:
    """Generate from each of `inputs` in turn with `idiom`; each equals eager's tokens row by row. Returns the
    number of graphs each generate() compiled."""
    eager_kwargs = static_cache(compiled=False) if idiom == "compile_config" else {}
    expected = [greedy(model.generate, x, tokens, **eager_kwargs) for x in inputs]
    generate, kwargs = compile_for_generate(model, idiom)
    counts = []
    for x, want in zip(inputs, expected):
        before = len(compiles)
        got = greedy(generate, x, tokens, **kwargs)
        counts.append(len(compiles) - before)
        for row in range(want.shape[0]):
            assert torch.equal(got[row], want[row]), (row, got[row, -tokens:].tolist(), want[row, -tokens:].tolist())
    assert_no_fallback(compiles, recwarn)
    return counts


# Default run: the cheap checks that catch each idiom breaking.

@pytest.mark.parametrize("name", ["deepseek_v32", "kimi_linear"])
def test_compiled_forward_generates_eager_tokens(name, tiny_transformers, compiles, recwarn):
    """Idiom 1: model.forward = torch.compile(model.forward, backend="ascend_dsa"), default DynamicCache; a second
    prompt of the same length compiles nothing (no guard on the cache object or the prompt's values)."""
    counts = check_idiom(tiny_transformers(name), "forward", [prompt(12, 1), prompt(12, 2)], TOKENS, compiles,
                         recwarn)
    assert counts == [3, 0]
    if name == "deepseek_v32":      # the symbolic decode graph reads its mask once for every fused indexer and
        decode = compiles[2][-1].fused_ops      # sparse attention (the model spells it two ways: one node after
        assert decode["causal_lengths"] == 1 and decode["lightning_indexer"] == 2, decode   # canonicalize)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v32", "llama"])
def test_inductor_glue_generates_eager_tokens(tiny_transformers, compiles, recwarn, monkeypatch, name):
    """Idiom 1 with the default glue choice ("auto"; the suite runs Python glue otherwise, tests/conftest.py): the
    graphs start on their Python glue while the glue worker compiles Inductor's (npu_graph.runtime.glue_upgrade),
    except a symbolic graph of many calls, compiled with its glue (deepseek_v32's decode graph);
    once it has landed the decode graph runs as Inductor's module with the fused ops called directly, tokens equal
    eager's before and after, and nothing recompiles: llama's prefill under Inductor's module gives the key cache
    the layout its Python glue gave (npu_graph.runtime.glue_layouts; without it the next step's guards failed).
    Slow: Inductor compiles C++ for three graphs (~1 min on a 2-core machine with its caches cold);
    tests/targets/test_glue_upgrade.py covers the switch in the default run."""
    monkeypatch.setenv("ASCEND_DSA_CPU_GLUE", "auto")
    model = tiny_transformers(name)
    inputs = [prompt(12, seed) for seed in (1, 2, 3)]
    expected = [greedy(model.generate, x, TOKENS) for x in inputs]
    generate, _ = compile_for_generate(model, "forward")
    for step, (x, want) in enumerate(zip(inputs, expected)):
        if step == 2:
            assert glue_upgrade.wait_all(timeout=900)
        assert torch.equal(greedy(generate, x, TOKENS), want), step
    assert_no_fallback(compiles, recwarn)
    assert len(compiles) == 3
    runtime = [report.extra["runtime"] for reports in compiles for report in reports]
    assert runtime[-1]["glue"] == "inductor", runtime      # the symbolic decode graph, which every later step runs
    reasons = [r["glue_reason"] for r in runtime if r["glue"] == "inductor"]
    assert all("compiled in the background" in r or "compiled with the graph" in r for r in reasons), runtime
    # deepseek_v32's decode graph makes >= NOW_MIN_GLUE_NODES calls: compiled with it; llama's in the background
    assert ("compiled with the graph" in runtime[-1]["glue_reason"]) == (name == "deepseek_v32"), runtime


def test_optimized_module_generate_runs_eagerly(tiny_transformers, compiles, recwarn):
    """Idiom 2: torch.compile(model) returns an OptimizedModule whose generate is the original module's bound
    method (OptimizedModule.__getattr__), so generate() calls the uncompiled model: eager tokens, no graph.
    Calling the OptimizedModule itself does compile. model.compile() is the in-place way that generate() uses."""
    model = tiny_transformers("llama")
    compiled = torch.compile(model, backend="ascend_dsa")
    assert compiled.generate.__self__ is model
    counts = check_idiom(model, "optimized_module", [prompt(12, 1)], TOKENS, compiles, recwarn)
    assert counts == [0]
    with torch.no_grad():
        compiled(prompt(12, 1)[0])
    assert len(compiles) == 1
    assert_no_fallback(compiles, recwarn)


def test_compile_config_compiles_the_decode_step(tiny_transformers, compiles, recwarn):
    """Idiom 3: generate(cache_implementation="static", compile_config=CompileConfig(backend="ascend_dsa")); one
    decode graph, reused by a longer and a shorter prompt."""
    counts = check_idiom(tiny_transformers("deepseek_v32"), "compile_config", [prompt(n, i) for i, n in
                         enumerate(LENGTHS)], 8, compiles, recwarn)
    assert counts == COMPILES["compile_config"]


def test_compile_config_is_skipped_on_cpu_by_default(tiny_transformers, compiles):
    """Without CompileConfig._compile_all_devices, transformers compiles only on cuda/xpu/neuron/tpu: on CPU it
    logs that compilation is skipped and generates eagerly (the test above sets the flag)."""
    model = tiny_transformers("llama")
    greedy(model.generate, prompt(12, 1), 4, cache_implementation="static",
           compile_config=transformers.CompileConfig(backend="ascend_dsa"))
    assert compiles == []


@pytest.mark.parametrize(("name", "tokens", "graphs"), [
    ("qwen3_moe", 8, 3),
    ("deepseek_v32", 8, 3),
])
def test_left_padded_batch_generates_eager_tokens_per_row(name, tokens, graphs, tiny_transformers, compiles,
                                                          recwarn):
    """Idiom 4: three prompts of different lengths, left-padded with pad_token_id 0 and masked, through a
    compiled forward: each row's tokens equal the eager batch's."""
    counts = check_idiom(tiny_transformers(name), "forward", [left_padded([12, 7, 4], 1)], tokens, compiles,
                         recwarn)
    assert counts == [graphs]


# Slow: every family × idiom, 32 tokens, three prompt lengths.

def _matrix():
    for idiom in COMPILES:
        for name in FAMILIES:
            yield pytest.param(name, idiom, id=f"{name}-{idiom}")
    for name in FAMILIES:
        yield pytest.param(name, "left_padded", id=f"{name}-left_padded")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "idiom"), _matrix())
def test_generate_matrix(name, idiom, tiny_transformers, compiles, recwarn):
    if idiom == "left_padded":
        inputs = [left_padded([12, 7, 4], 1), left_padded([9, 15, 5], 2), left_padded([3, 6, 8], 3)]
        counts = check_idiom(tiny_transformers(name), "forward", inputs, TOKENS, compiles, recwarn)
        assert counts == COMPILES["forward"]
    else:
        inputs = [prompt(n, i) for i, n in enumerate(LENGTHS)]
        counts = check_idiom(tiny_transformers(name), idiom, inputs, TOKENS, compiles, recwarn)
        assert counts == COMPILES[idiom]


def test_batched_prompts_with_a_mask_of_ones_fuse_dsa(tiny_transformers):
    """A [B, 1, S, K] attention mask with B > 1: its head dim (not the batch dim) is dropped for the lengths."""
    model = tiny_transformers("deepseek_v32")
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    backend = npu_graph.get_backend({"strict": True, "cache": False})
    with torch.no_grad():
        ref = model(ids, attention_mask=torch.ones_like(ids)).logits
        out = torch.compile(model, backend=backend)(ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert backend.reports[-1].fused_ops["sparse_flash_attention"] == 2

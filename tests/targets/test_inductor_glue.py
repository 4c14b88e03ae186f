"""Inductor as the code for the work between fused ops (npu_graph.runtime.inductor_glue, option cpu.glue): what
"auto" picks and why, results equal to the Python form's, fused ops called as their implementations, the dump
showing what runs, and graphs Inductor's module alone cannot run staying in Python."""
import json
import re
import types
import warnings

import pytest
import torch

import npu_graph  # noqa: F401  (registers the fused ops)
from npu_graph.backend import CompilationFallbackWarning
from npu_graph.config import CompilerConfig, ConfigError
from npu_graph.runtime import inductor_glue


def _norm_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An RMSNorm the passes fuse, between chains of small elementwise ops and views."""
    for _ in range(3):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        x = (torch.sigmoid(x) + x.transpose(0, 1).reshape(x.shape) * 0.5).relu()
    return x


def _norm_chain_with_lengths(x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """_norm_chain, scaled by the key lengths of a causal mask (a fused op that stays one call)."""
    _, lengths, _ = torch.ops.ascend_dsa.causal_lengths(mask)
    return _norm_chain(x, w) * lengths.float().sum()


def _summaries(dump) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(dump.glob("*/summary.json"))]


def _compiled(fn, options: dict, *args):
    compiled = torch.compile(fn, backend="ascend_dsa", options=options)
    with torch.no_grad():
        return compiled(*args)


def test_inductor_glue_equals_python_and_calls_fused_ops_directly(tmp_path):
    """The RMSNorms are fused by the passes, then written out in Inductor's loops; causal_lengths stays a call,
    bound to its implementation."""
    x, w, mask = torch.randn(4, 4, 32), torch.randn(32), torch.ones(1, 4, 4, dtype=torch.bool).tril()
    expected = _compiled(_norm_chain_with_lengths, {"cache": False, "cpu_glue": "python"}, x, w, mask)
    torch._dynamo.reset()
    got = _compiled(_norm_chain_with_lengths, {"cache": False, "cpu_glue": "inductor", "dump_dir": str(tmp_path)},
                    x, w, mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    (summary,) = _summaries(tmp_path)
    assert summary["runtime"]["glue"] == "inductor", summary["runtime"]
    assert summary["fused_ops"].get("rms_norm"), summary["fused_ops"]
    source = next(tmp_path.glob("*/compiled.py")).read_text()
    assert source.startswith("GLUE = 'inductor'\n") or "\nGLUE = 'inductor'\n" in source
    assert "_ascend_dsa_direct_causal_lengths(" in source        # a fused op called as its implementation
    assert "_ascend_dsa_direct_rms_norm(" not in source            # an elementwise one written out for Inductor
    assert not re.search(r"torch\.ops\.ascend_dsa\.\w+\.default\(", source)   # no call through the dispatcher
    assert "def call(self, args)" in source and "\ndef forward(self, *inputs):" in source
    assert "\nasync_compile = BatchedKernels()\n" in source   # its kernels built as a few libraries
    assert "AOT ID" not in source     # a per-process counter: compiled again (a cache hit's dump), the code is equal


def test_auto_keeps_small_graphs_in_python(tmp_path):
    x, w = torch.randn(4, 4, 32), torch.randn(32)
    _compiled(_norm_chain, {"cache": False, "cpu_glue": "auto", "dump_dir": str(tmp_path)}, x, w)
    (summary,) = _summaries(tmp_path)
    assert summary["runtime"]["glue"] == "python"
    assert f"(< {inductor_glue.MIN_GLUE_NODES})" in summary["runtime"]["glue_reason"]


def _graph_of(fn, *args) -> torch.fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(a) for a in args]
        return make_fx(fn)(*fakes)


def test_worth_compiling_reads_call_count_and_sizes():
    def chain(x):
        for _ in range(inductor_glue.MIN_GLUE_NODES):
            x = x + 1
        return x
    worth, reason = inductor_glue.worth_compiling(_graph_of(chain, torch.randn(1, 64)))
    assert worth, reason
    worth, reason = inductor_glue.worth_compiling(_graph_of(chain, torch.randn(256, 512)))
    assert not worth and "do real work" in reason
    worth, reason = inductor_glue.worth_compiling(_graph_of(lambda x: x + 1, torch.randn(1, 64)))
    assert not worth and "ATen calls" in reason


def test_plain_metadata_is_required():
    def meta(**kw):
        base = dict(num_mutated_inp_runtime_indices=0, num_intermediate_bases=0, tokens={}, output_info=[])
        return types.SimpleNamespace(**{**base, **kw})
    out = types.SimpleNamespace
    inductor_glue._check_plain(meta(output_info=[out(output_type=types.SimpleNamespace(name="non_alias"))]))
    with pytest.raises(inductor_glue.GlueUnsupported, match="input mutations"):
        inductor_glue._check_plain(meta(num_mutated_inp_runtime_indices=1))
    with pytest.raises(inductor_glue.GlueUnsupported, match="alias_of_input"):
        inductor_glue._check_plain(meta(output_info=[out(output_type=types.SimpleNamespace(name="alias_of_input"))]))
    with pytest.raises(inductor_glue.GlueUnsupported, match="no view and mutation metadata"):
        inductor_glue._check_plain(None)


def test_glue_setting_is_validated_and_read_from_the_environment():
    assert CompilerConfig.from_options({}, env={}).cpu.glue == "auto"
    assert CompilerConfig.from_options({}, env={"ASCEND_DSA_CPU_GLUE": "python"}).cpu.glue == "python"
    assert CompilerConfig.from_options({"cpu_glue": "inductor"}, env={"ASCEND_DSA_CPU_GLUE": "python"}).cpu.glue \
        == "inductor"
    with pytest.raises(ConfigError, match=r"cpu\.glue"):
        CompilerConfig.from_options({"cpu_glue": "c++"}, env={})


def test_explicit_inductor_glue_that_cannot_run_falls_back_with_a_warning():
    """An output that is a view of an input is rebuilt by AOT autograd's runtime wrapper, which Inductor's module
    alone does not run: asked for explicitly, the graph runs eagerly with the reason."""
    def view_out(x):
        return x.view(-1), (x * 2).sum()
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _compiled(view_out, {"cache": False, "cpu_glue": "inductor"}, x)
    assert torch.equal(got[0], x.view(-1)) and torch.equal(got[1], (x * 2).sum())
    messages = [str(w.message) for w in caught if issubclass(w.category, CompilationFallbackWarning)]
    assert messages and "AOT autograd" in messages[0], messages


def _decode_linears(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """A decode row through three linear layers and a gate: products Inductor leaves to extern_kernels.mm."""
    h = torch.nn.functional.silu(x @ w1) * (x @ w2)
    return (h @ w3).relu()


def test_inductor_products_are_bound_like_the_runtimes_own(tmp_path, monkeypatch):
    """Inductor's `extern_kernels.mm(a, b, out=buf)` runs the native skinny product into buf (or torch.mm on one
    thread when small) instead of BLAS forking its team for a decode row; results equal the Python form's."""
    monkeypatch.setenv("ASCEND_DSA_NATIVE", "1")
    g = torch.Generator().manual_seed(3)
    args = (torch.randn(1, 64, generator=g), torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g),
            torch.randn(256, 64, generator=g))
    expected = _compiled(_decode_linears, {"cache": False, "cpu_glue": "python"}, *args)
    torch._dynamo.reset()
    got = _compiled(_decode_linears, {"cache": False, "cpu_glue": "inductor", "dump_dir": str(tmp_path)}, *args)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    source = next(tmp_path.glob("*/compiled.py")).read_text()
    sites = re.findall(r"(_extern_mm_\d+) = _bind.extern\('mm'\)", source)
    assert len(sites) == len(set(sites)) >= 3, sites             # a binding of its own per call site
    assert all(source.count(site + "(") == 1 for site in sites) and "extern_kernels.mm(" not in source


def test_the_glue_checks_no_input_layouts_and_dynamo_guards_them(tmp_path):
    """Inductor's module is generated without its per-call size and stride asserts: the graph's inputs reach it
    through Dynamo's guards, so an input of the same sizes but other strides recompiles instead of being read with
    the wrong layout; every call's result equals eager's."""
    def gated_rows(x, w):
        return torch.sigmoid(x * w + 1.0).sum(-1, keepdim=True) * x

    compiled = torch.compile(gated_rows, backend="ascend_dsa",
                             options={"cache": False, "cpu_glue": "inductor", "dump_dir": str(tmp_path)})
    x, w = torch.randn(8, 32), torch.randn(32)
    transposed = torch.randn(32, 8).t()                       # sizes (8, 32), strides (1, 8)
    with torch.no_grad():
        for value in (x, transposed, x + 1):
            torch.testing.assert_close(compiled(value, w), gated_rows(value, w), rtol=1e-5, atol=1e-5)
    sources = [path.read_text() for path in tmp_path.glob("*/compiled.py")]
    assert len(sources) >= 2 and all("GLUE = 'inductor'" in s for s in sources)      # two layouts, two graphs
    assert not any("assert_size_stride(" in s for s in sources)


def _first_cache_update(x, w, empty):
    """transformers' DynamicCache on its first update: cat([empty, key_states], -2), key_states a transposed view."""
    keys = (x @ w).view(1, 8, 4, 16).transpose(1, 2)
    return torch.cat([empty, keys], -2), keys.sum()


def test_inductor_glue_keeps_the_graphs_output_layouts(tmp_path):
    """Inductor's decomposition of cat drops the empty input and clones the transposed one: its module would lay the
    result out [1, 8, 4, 16]-major where eager and the Python glue give it contiguous. The adapter makes that output
    contiguous (the dump shows it), so a graph switching glue mid-run hands later graphs the layout their guards
    were traced with."""
    args = (torch.randn(8, 64), torch.randn(64, 64), torch.zeros(1, 4, 0, 16))
    want = _first_cache_update(*args)
    got = _compiled(_first_cache_update, {"cache": False, "cpu_glue": "inductor", "dump_dir": str(tmp_path)}, *args)
    assert got[0].stride() == want[0].stride() == (512, 128, 16, 1)
    torch.testing.assert_close(got, want)
    source = next(tmp_path.glob("*/compiled.py")).read_text()
    assert "GLUE = 'inductor'" in source and "made contiguous" in source


def test_outputs_to_relayout_mends_contiguous_outputs_and_refuses_the_rest():
    from npu_graph.runtime.glue_layouts import LayoutMismatch, outputs_to_relayout
    s0 = torch.fx.experimental.symbolic_shapes.ShapeEnv().create_unbacked_symint()    # a symbolic cache length
    traced = [((1, 4, 8, 16), (512, 128, 16, 1)), ((4, s0), (s0, 1)), None]
    assert outputs_to_relayout(traced, [("512", "128", "16", "1"), (str(s0), "1"), None], ["non_alias"] * 3) == ()
    assert outputs_to_relayout(traced, [("512", "16", "64", "1"), (str(s0), "1"), None], ["non_alias"] * 3) == (0,)
    with pytest.raises(LayoutMismatch, match="output 1"):      # the graph's own layout is not contiguous
        outputs_to_relayout([None, ((4, 8), (1, 4))], [None, ("8", "1")], ["non_alias"] * 2)
    with pytest.raises(LayoutMismatch, match="output 0"):      # a copy would break the alias
        outputs_to_relayout(traced[:1], [("512", "16", "64", "1")], ["alias_of_intermediate"])
    with pytest.raises(LayoutMismatch, match="no layout"):
        outputs_to_relayout(traced, None, ["non_alias"] * 3)
    s1 = torch.fx.experimental.symbolic_shapes.ShapeEnv().create_unbacked_symint()
    assert outputs_to_relayout([((4, s1), (s1, 1))], [("1", "4")], ["non_alias"]) == (0,)   # symbolic, contiguous

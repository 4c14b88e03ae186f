"""fuse_rms_norm on the ways models write RMSNorm: the ATen op sets around the pass, the pattern counted, and
numbers equal to eager in fp32 and bf16 (within the op's tolerance: one rounding of the output dtype)."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from npu_graph.models.norm import GatedRMSNorm, RMSNorm
from npu_graph.passes import fuse_rms_norm

D = 64
EPS = 1e-6
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2 ** -7, 1e-5)}
DTYPES = [torch.float32, torch.bfloat16]


def run(watch_pass, fn, *args, options=None, dynamic=None):
    """Eager (ref) and compiled (out) results, the report, the pass stats and the op sets before/after it."""
    watched = watch_pass(fuse_rms_norm, fn, *args, options=options, dynamic=dynamic)
    return SimpleNamespace(ref=watched.ref, out=watched.out, report=watched.report, stats=watched.stats,
                           before=watched.before_names, after=watched.after_names)


def inputs(dtype, shape=(2, 5, D)):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3
    return x.to(dtype), (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)


def assert_close(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


def with_weight(module, w):
    module = module.to(w.dtype)
    module.weight.data.copy_(w)
    return module


def reference_module(w):
    return with_weight(RMSNorm(D, EPS), w)


def llama_module(w):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    return with_weight(llama.LlamaRMSNorm(D, EPS), w)


def gated(w):
    norm = with_weight(GatedRMSNorm(D, EPS), w)
    return lambda x: norm(x, x.flip(-1))


def functional(w):
    return lambda x: F.rms_norm(x, (D,), w, EPS)


def gemma_style(w):
    def norm(x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        return (h * (1.0 + w.float())).type_as(x)
    return norm


def reciprocal_sqrt(w):
    def norm(x):
        h = x.float()
        h = h * (1 / torch.sqrt((h * h).mean(-1, keepdim=True) + EPS))
        return w * h.to(x.dtype)
    return norm


def div_by_sqrt(w):
    def norm(x):
        h = x.float()
        return (h / torch.sqrt(h.pow(2).mean(dim=-1, keepdim=True) + EPS) * w).to(x.dtype)
    return norm


def no_weight(w):
    def norm(x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) + w
    return norm


# (make(weight) -> fn(x), where the weight ends up inside the op: "always", "fp32" (cast back first: only fp32 skips the
# cast), "never")
VARIANTS = {
    "reference_model": (reference_module, "fp32"),
    "llama": (llama_module, "fp32"),
    "functional_rms_norm": (functional, "always"),
    "gemma_one_plus_weight": (gemma_style, "always"),
    "reciprocal_sqrt": (reciprocal_sqrt, "fp32"),
    "div_by_sqrt": (div_by_sqrt, "always"),
    "no_weight": (no_weight, "never"),
    "gated_fp32_result": (gated, "always"),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_becomes_one_rms_norm(watch_pass, variant, dtype):
    make, weight_in_op = VARIANTS[variant]
    x, w = inputs(dtype)
    r = run(watch_pass, make(w), x)
    fused_weight = weight_in_op == "always" or (weight_in_op == "fp32" and dtype == torch.float32)
    pattern = fuse_rms_norm.PATTERN_WEIGHTED if fused_weight else fuse_rms_norm.PATTERN
    assert r.stats == {"matches": {pattern: 1}, "near_misses": []}
    assert r.report.fused_ops == {"rms_norm": 1}
    assert "aten.mean" in r.before and "aten.mean" not in r.after and "ascend_dsa.rms_norm" in r.after
    assert r.before & {"aten.rsqrt", "aten.sqrt"} and not r.after & {"aten.rsqrt", "aten.sqrt", "aten.reciprocal"}
    assert_close(r.out, r.ref, dtype)


def test_weight_after_the_cast_back_stays_a_separate_multiply_in_bf16(watch_pass):
    """w * norm(x).to(bf16) rounds twice; the op rounds once, so it normalizes with ones and w stays."""
    x, w = inputs(torch.bfloat16)
    r = run(watch_pass, reference_module(w), x)
    assert "aten.mul" in r.after and "aten.ones" in r.after
    assert torch.equal(r.out, r.ref)


def test_symbolic_sizes(watch_pass):
    x, w = inputs(torch.float32)
    torch._dynamo.mark_dynamic(x, 1)
    r = run(watch_pass, reference_module(w), x)
    assert r.report.fused_ops == {"rms_norm": 1}
    assert_close(r.out, r.ref, torch.float32)


def test_eps_that_dynamic_true_made_a_tensor_becomes_a_constant_again(watch_pass):
    """dynamic=True passes the module's float eps as a 0-dim tensor; the pass asks Dynamo to trace again with it a
    constant (which Dynamo guards), and the norm fuses with symbolic sizes."""
    x, w = inputs(torch.float32)
    r = run(watch_pass, reference_module(w), x, dynamic=True)
    assert r.report.fused_ops == {"rms_norm": 1} and r.stats["near_misses"] == []
    assert_close(r.out, r.ref, torch.float32)


def test_norm_times_a_gate_fuses_the_norm_and_keeps_the_gate(watch_pass):
    def gated(x, w):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        return (w * h) * torch.sigmoid(x.flip(-1))

    r = run(watch_pass, gated, *inputs(torch.float32))
    assert r.report.fused_ops == {"rms_norm": 1} and "aten.sigmoid" in r.after
    assert_close(r.out, r.ref, torch.float32)


def test_graph_without_rms_norm_is_unchanged(watch_pass):
    def l2_and_softmax(x, w):
        return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + EPS) + (x * w).softmax(-1)

    r = run(watch_pass, l2_and_softmax, *inputs(torch.float32))
    assert r.stats == {"matches": {}, "near_misses": []} and r.before == r.after and r.report.fused_ops == {}
    assert torch.equal(r.out, r.ref)


def test_norm_computed_in_bf16_is_a_near_miss(watch_pass):
    def low_precision(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w

    r = run(watch_pass, low_precision, *inputs(torch.bfloat16))
    assert r.report.fused_ops == {} and r.before == r.after and torch.equal(r.out, r.ref)
    assert [m["reason"] for m in r.stats["near_misses"]] == [
        "the norm is computed in torch.bfloat16; rms_norm computes in float32"]


def test_mean_over_another_dim_is_a_near_miss(watch_pass):
    def column_norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + EPS) * w

    r = run(watch_pass, column_norm, *inputs(torch.float32))
    assert r.report.fused_ops == {} and torch.equal(r.out, r.ref)
    assert "not over the last dim" in r.stats["near_misses"][0]["reason"]


def test_a_norm_whose_result_keeps_a_transposed_layout_is_a_near_miss(watch_pass):
    """x * rsqrt(...) of a transposed x is transposed too, and the graph may view it as such (here a transpose
    back, then a view): rms_norm writes a contiguous result, so the chain is left as it is — the graph compiles
    and equals eager instead of failing in the pass."""
    def norm_then_view(x, w):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w
        return y.transpose(0, 1).view(-1)

    x = torch.randn(32, 8).t()
    r = run(watch_pass, norm_then_view, x, torch.randn(32))
    assert r.report.fused_ops == {} and torch.equal(r.out, r.ref)
    assert "not contiguous" in r.stats["near_misses"][0]["reason"]

"""fuse_add_rms_norm: a residual add whose sum is normalized (and usually used again) becomes one
add_rms_norm; op sets around the pass, pattern counts, numbers equal to eager in fp32 and bf16."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from npu_graph.models.norm import RMSNorm
from npu_graph.passes import fuse_add_rms_norm

D = 64
EPS = 1e-6
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2 ** -7, 1e-5)}
DTYPES = [torch.float32, torch.bfloat16]


def run(watch_pass, fn, *args):
    """Eager (ref) and compiled (out) results, the report, the pass stats and the op sets before/after it."""
    watched = watch_pass(fuse_add_rms_norm, fn, *args)
    return SimpleNamespace(ref=watched.ref, out=watched.out, report=watched.report, stats=watched.stats,
                           before=watched.before_names, after=watched.after_names)


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(2, 5, D, generator=g), torch.randn(2, 5, D, generator=g) * 2
    return x.to(dtype), r.to(dtype), (torch.rand(D, generator=g) + 0.5).to(dtype)


def assert_close(out, ref, dtype):
    rtol, atol = TOL[dtype]
    for o, e in zip(out, ref):
        assert o.dtype == e.dtype
        torch.testing.assert_close(o, e, rtol=rtol, atol=atol)


def reference_norm(w):
    norm = RMSNorm(D, EPS).to(w.dtype)
    norm.weight.data.copy_(w)
    return norm


def functional_norm(w):
    return lambda h: F.rms_norm(h, (D,), w, EPS)


def unweighted_norm(w):
    def norm(h):
        hf = h.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)
    return norm


NORMS = {"reference_model": reference_norm, "functional": functional_norm, "no_weight": unweighted_norm}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_residual_add_then_norm_becomes_add_rms_norm(watch_pass, norm, dtype):
    x, r, w = inputs(dtype)
    normalize = NORMS[norm](w)

    def block(x, r):
        h = x + r
        return normalize(h) * 2, h * 3

    out = run(watch_pass, block, x, r)
    assert out.stats == {"matches": {fuse_add_rms_norm.PATTERN: 1}, "near_misses": []}
    assert out.report.fused_ops == {"add_rms_norm": 1}
    assert {"aten.add", "ascend_dsa.rms_norm"} <= out.before
    assert "ascend_dsa.add_rms_norm" in out.after and "ascend_dsa.rms_norm" not in out.after
    assert "aten.add" not in out.after
    assert_close(out.out, out.ref, dtype)


def test_sum_used_before_the_norm_and_only_by_the_norm(watch_pass):
    x, r, w = inputs(torch.float32)
    normalize = reference_norm(w)

    def two_layers(x, r):
        h = x + r
        early = h.sigmoid()
        g = early + x
        return normalize(h), normalize(g)

    out = run(watch_pass, two_layers, x, r)
    assert out.stats["matches"] == {fuse_add_rms_norm.PATTERN: 2} and out.report.fused_ops == {"add_rms_norm": 2}
    assert_close(out.out, out.ref, torch.float32)


def test_plain_norm_is_unchanged(watch_pass):
    x, _, w = inputs(torch.float32)
    out = run(watch_pass, reference_norm(w), x)
    assert out.stats == {"matches": {}, "near_misses": []} and out.before == out.after
    assert out.report.fused_ops == {"rms_norm": 1}
    torch.testing.assert_close(out.out, out.ref, rtol=1e-5, atol=1e-6)


def test_bias_add_is_a_near_miss(watch_pass):
    x, _, w = inputs(torch.float32)
    normalize = reference_norm(w)
    out = run(watch_pass, lambda x, b: normalize(x + b), x, w * 0.1)
    assert out.report.fused_ops == {"rms_norm": 1} and out.before == out.after
    assert "broadcasts" in out.stats["near_misses"][0]["reason"]
    torch.testing.assert_close(out.out, out.ref, rtol=1e-5, atol=1e-6)


def test_weight_computed_after_a_use_of_the_sum_is_a_near_miss(watch_pass):
    x, r, w = inputs(torch.float32)

    def data_dependent_weight(x, r):
        h = x + r
        return F.rms_norm(h, (D,), w + h.mean((0, 1)), EPS)

    out = run(watch_pass, data_dependent_weight, x, r)
    assert out.report.fused_ops == {"rms_norm": 1}
    assert out.stats["near_misses"][0]["reason"] == "the sum is used before the norm's weight is computed"
    torch.testing.assert_close(out.out, out.ref, rtol=1e-5, atol=1e-6)

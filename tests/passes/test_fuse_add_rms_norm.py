"""fuse_add_rms_norm: a residual add whose sum is normalized (and usually used again) becomes one
add_rms_norm; op sets around the pass, pattern counts, numbers equal to eager in fp32 and bf16."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import npu_graph
from npu_graph.models.norm import RMSNorm
from npu_graph.passes import fuse_add_rms_norm

D = 64
EPS = 1e-6
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2 ** -7, 1e-5)}
DTYPES = [torch.float32, torch.bfloat16]


def op_names(gm):
    return {f"{n.target.namespace}.{n.target._opname}" for n in gm.graph.nodes
            if isinstance(n.target, torch._ops.OpOverload)}


def run(monkeypatch, fn, *args):
    """Eager (ref) and compiled (out) results, the report, the pass stats and the op sets before/after it."""
    sets = []
    real = fuse_add_rms_norm.run

    def spy(gm, ctx):
        sets.append(op_names(gm))
        result = real(gm, ctx)
        sets.append(op_names(gm))
        return result

    monkeypatch.setattr(fuse_add_rms_norm, "run", spy)
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False}))
    with torch.no_grad():
        ref = fn(*args)
        out = torch.compile(fn, backend=backend)(*args)
    report = backend.reports[-1]
    stats = next(p["stats"] for p in report.passes if p["name"] == fuse_add_rms_norm.NAME)
    return SimpleNamespace(ref=ref, out=out, report=report, stats=stats, before=sets[0], after=sets[1])


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
def test_residual_add_then_norm_becomes_add_rms_norm(monkeypatch, norm, dtype):
    x, r, w = inputs(dtype)
    normalize = NORMS[norm](w)

    def block(x, r):
        h = x + r
        return normalize(h) * 2, h * 3

    out = run(monkeypatch, block, x, r)
    assert out.stats == {"matches": {fuse_add_rms_norm.PATTERN: 1}, "near_misses": []}
    assert out.report.fused_ops == {"add_rms_norm": 1}
    assert {"aten.add", "ascend_dsa.rms_norm"} <= out.before
    assert "ascend_dsa.add_rms_norm" in out.after and "ascend_dsa.rms_norm" not in out.after
    assert "aten.add" not in out.after
    assert_close(out.out, out.ref, dtype)


def test_sum_used_before_the_norm_and_only_by_the_norm(monkeypatch):
    x, r, w = inputs(torch.float32)
    normalize = reference_norm(w)

    def two_layers(x, r):
        h = x + r
        early = h.sigmoid()
        g = early + x
        return normalize(h), normalize(g)

    out = run(monkeypatch, two_layers, x, r)
    assert out.stats["matches"] == {fuse_add_rms_norm.PATTERN: 2} and out.report.fused_ops == {"add_rms_norm": 2}
    assert_close(out.out, out.ref, torch.float32)


def test_plain_norm_is_unchanged(monkeypatch):
    x, _, w = inputs(torch.float32)
    out = run(monkeypatch, reference_norm(w), x)
    assert out.stats == {"matches": {}, "near_misses": []} and out.before == out.after
    assert out.report.fused_ops == {"rms_norm": 1}
    torch.testing.assert_close(out.out, out.ref, rtol=1e-5, atol=1e-6)


def test_bias_add_is_a_near_miss(monkeypatch):
    x, _, w = inputs(torch.float32)
    normalize = reference_norm(w)
    out = run(monkeypatch, lambda x, b: normalize(x + b), x, w * 0.1)
    assert out.report.fused_ops == {"rms_norm": 1} and out.before == out.after
    assert "broadcasts" in out.stats["near_misses"][0]["reason"]
    torch.testing.assert_close(out.out, out.ref, rtol=1e-5, atol=1e-6)


def test_weight_computed_after_a_use_of_the_sum_is_a_near_miss(monkeypatch):
    x, r, w = inputs(torch.float32)

    def data_dependent_weight(x, r):
        h = x + r
        return F.rms_norm(h, (D,), w + h.mean((0, 1)), EPS)

    out = run(monkeypatch, data_dependent_weight, x, r)
    assert out.report.fused_ops == {"rms_norm": 1}
    assert out.stats["near_misses"][0]["reason"] == "the sum is used before the norm's weight is computed"
    torch.testing.assert_close(out.out, out.ref, rtol=1e-5, atol=1e-6)

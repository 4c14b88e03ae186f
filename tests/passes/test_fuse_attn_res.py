"""fuse_attn_res: softmax over depth of RMS-normalized sources becomes one attn_res (from the fused rms_norm
or the raw norm; einsum, matmul and `*`+`sum` forms; depth on any axis); op sets around the pass, pattern
counts, eager numbers in fp32 and bf16 (the op's tolerance); and the reference HybridLM end to end."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import npu_graph
from npu_graph.models.attn_res import AttnRes
from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.passes import fuse_attn_res

B, T, D, N = 2, 5, 64, 3
EPS = 1e-6
# attn_res computes in fp32; bf16 eager rounds keys and logits to bf16 (the op's declared bf16 tolerance)
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def op_names(gm):
    return {f"{n.target.namespace}.{n.target._opname}" for n in gm.graph.nodes
            if isinstance(n.target, torch._ops.OpOverload)}


def run(monkeypatch, fn, *args, options=None):
    """Eager (ref) and compiled (out) results, the report, the pass stats and the op sets before/after it."""
    sets = []
    real = fuse_attn_res.run

    def spy(gm, ctx):
        sets.append(op_names(gm))
        result = real(gm, ctx)
        sets.append(op_names(gm))
        return result

    monkeypatch.setattr(fuse_attn_res, "run", spy)
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False, **(options or {})}))
    with torch.no_grad():
        ref = fn(*args)
        out = torch.compile(fn, backend=backend)(*args)
    report = backend.reports[-1]
    stats = next(p["stats"] for p in report.passes if p["name"] == fuse_attn_res.NAME)
    return SimpleNamespace(ref=ref, out=out, report=report, stats=stats, before=sets[0], after=sets[1])


def sources(dtype, n=N):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(B, T, D, generator=g) * (i + 1)).to(dtype) for i in range(n)]


def module(dtype):
    torch.manual_seed(0)
    res = AttnRes(D, EPS).to(dtype)
    torch.nn.init.normal_(res.query, std=0.3)
    torch.nn.init.uniform_(res.norm.weight, 0.5, 1.5)
    return res


def assert_fused(out, dtype):
    assert out.stats == {"matches": {fuse_attn_res.PATTERN: 1}, "near_misses": []}
    assert out.report.fused_ops == {"attn_res": 1}
    assert "aten._softmax" in out.before and "aten._softmax" not in out.after
    assert "ascend_dsa.attn_res" in out.after and "ascend_dsa.rms_norm" not in out.after
    assert out.out.dtype == out.ref.dtype
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.out, out.ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_attn_res_over_fused_rms_norm(monkeypatch, dtype):
    out = run(monkeypatch, module(dtype), sources(dtype))
    assert "ascend_dsa.rms_norm" in out.before
    assert_fused(out, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_attn_res_over_the_raw_norm(monkeypatch, dtype):
    out = run(monkeypatch, module(dtype), sources(dtype), options={"disabled_passes": ["fuse_rms_norm"]})
    assert {"aten.rsqrt", "aten.mean"} <= out.before and not {"aten.rsqrt", "aten.mean"} & out.after
    assert_fused(out, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_depth_last_with_matmul_scale_and_mul_sum(monkeypatch, dtype):
    res = module(dtype)

    def depth_last(srcs):
        values = torch.stack(srcs, dim=2)                                    # [B, T, N, D]
        keys = F.rms_norm(values, (D,), res.norm.weight, EPS)
        logits = (keys @ res.query[:, None]).squeeze(-1) * D ** -0.5        # [B, T, N]
        weights = logits.softmax(dim=-1)
        return (weights.unsqueeze(-1) * values).sum(dim=2)

    assert_fused(run(monkeypatch, depth_last, sources(dtype)), dtype)


def test_single_source_is_left_alone(monkeypatch):
    out = run(monkeypatch, module(torch.float32), sources(torch.float32, n=1))
    assert out.stats == {"matches": {}, "near_misses": []} and out.before == out.after
    torch.testing.assert_close(out.out, out.ref)


def test_ordinary_attention_is_unchanged_and_not_a_near_miss(monkeypatch):
    def attention(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * D ** -0.5, dim=-1) @ v

    q, k, v = sources(torch.float32)
    out = run(monkeypatch, attention, q, k, v)
    assert out.stats == {"matches": {}, "near_misses": []} and out.before == out.after
    torch.testing.assert_close(out.out, out.ref)


def test_per_token_temperature_is_a_near_miss(monkeypatch):
    res = module(torch.float32)

    def with_temperature(srcs, temperature):
        values = torch.stack(srcs)
        logits = torch.einsum("d,nbtd->nbt", res.query, res.norm(values)) * temperature
        return torch.einsum("nbt,nbtd->btd", logits.softmax(dim=0), values)

    out = run(monkeypatch, with_temperature, sources(torch.float32), torch.rand(B, T) + 0.5)
    assert out.report.fused_ops == {"rms_norm": 1} and out.before == out.after
    assert out.stats["near_misses"][0]["reason"] == "a factor of the logits depends on more than the hidden axis"
    torch.testing.assert_close(out.out, out.ref)


def test_reference_model_prefill_and_decode():
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named("tiny")).eval()
    for res in (m for m in model.modules() if isinstance(m, AttnRes)):
        torch.nn.init.normal_(res.query, std=0.3)
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False}))
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    eager_cache, compiled_cache = model.new_cache(2), model.new_cache(2)
    with torch.no_grad():
        for _ in range(3):
            ref, out = model(ids, eager_cache), compiled(ids, compiled_cache)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            ids = ref[:, -1:].argmax(-1)
    assert len(backend.reports) == 2
    for report in backend.reports:
        assert report.fallback is None
        # 9 AttnRes sites; the first layer's mixer input has one source (softmax over one: not fused)
        assert report.fused_ops["attn_res"] == 8 and report.fused_ops["rms_norm"] == 16

"""kernels/aten/dense_attention: the native small-head-dim attention against torch's CPU flash kernel and a float64
reference on random inputs (causal and not, more or fewer keys than queries, grouped-query heads, strided
layouts, v zero-padded past its real head dim, NaN inputs), torch's output layouts, the fallbacks to torch's
kernel, and the runtime binding of the generated source's flash calls."""
import pytest
import torch
from native_paths import refuse

from npu_graph.kernels.aten import dense_attention
from npu_graph.kernels.native import loader as native

LOADED, WHY = native.available(dense_attention.NATIVE_SOURCE)
needs_native = pytest.mark.skipif(not LOADED, reason=f"native kernel not available: {WHY}")
pytestmark = pytest.mark.usefixtures("isa_level")
aten_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def reference(q, k, v, causal, scale):
    """(out, logsumexp) in float64 with k and v repeated over query-head groups; causal is top-left aligned."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(groups, 1) for x in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    if causal:
        rows, cols = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(rows, cols, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def no_torch_fallback(monkeypatch):
    refuse(monkeypatch, dense_attention, "_aten_flash", said="fell back to torch's kernel")


def random_qkv(shape_q, shape_kv, seed, dv=None):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(shape_q, generator=g), torch.randn(shape_kv, generator=g)
    v = torch.randn(*shape_kv[:-1], dv or shape_kv[-1], generator=g)
    return q, k, torch.nn.functional.pad(v, (0, shape_kv[-1] - v.shape[-1]))


@needs_native
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("batch", "hq", "hk", "lq", "lk", "dim"), [
    (1, 4, 4, 2048, 2048, 24), (2, 4, 2, 100, 100, 24), (1, 2, 2, 64, 300, 8), (1, 3, 1, 130, 70, 32),
    (1, 1, 1, 64, 1, 1), (3, 2, 2, 65, 129, 17), (1, 8, 2, 257, 257, 16)])
def test_native_matches_reference(batch, hq, hk, lq, lk, dim, causal, monkeypatch):
    q, k, v = random_qkv((batch, hq, lq, dim), (batch, hk, lk, dim), seed=lq * dim + hq)
    no_torch_fallback(monkeypatch)
    out, lse = dense_attention.flash_attention_for_cpu(q, k, v, 0.0, causal, scale=0.3)
    ref_out, ref_lse = reference(q, k, v, causal, 0.3)
    assert out.dtype == torch.float32 and out.shape == q.shape and out.stride() == q.stride()
    assert lse.shape == (batch, hq, lq) and lse.stride() == (lq * hq, 1, hq)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=2e-6)


@needs_native
@pytest.mark.parametrize("causal", [True, False])
def test_same_as_torch_kernel_with_default_scale_and_strided_layouts(causal, monkeypatch):
    """q, k and v as [B, L, H, D] buffers seen as [B, H, L, D] (what projections give): out takes q's layout."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 150, 4, 24, generator=g).transpose(1, 2) for _ in range(3))
    expected = aten_flash(q, k, v, 0.0, causal)
    no_torch_fallback(monkeypatch)
    out, lse = dense_attention.flash_attention_for_cpu(q, k, v, 0.0, causal)
    assert out.stride() == expected[0].stride() and lse.stride() == expected[1].stride()
    torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse, expected[1], rtol=1e-5, atol=2e-6)


@needs_native
def test_zero_padded_value_columns_are_exact_zeros(monkeypatch):
    """MLA's v padded 16 -> 24 by fuse_attention: the padding columns come out 0, the rest as unpadded."""
    q, k, v = random_qkv((1, 4, 300, 24), (1, 4, 300, 24), seed=9, dv=16)
    no_torch_fallback(monkeypatch)
    out, _ = dense_attention.flash_attention_for_cpu(q, k, v, 0.0, True)
    assert (out[..., 16:] == 0).all()
    torch.testing.assert_close(out[..., :16].double(), reference(q, k, v[..., :16], True, 24 ** -0.5)[0],
                               rtol=1e-5, atol=2e-6)


@needs_native
def test_nan_rows_are_nan_in_every_column(monkeypatch):
    q, k, v = random_qkv((1, 2, 64, 24), (1, 2, 64, 24), seed=4, dv=16)
    q[0, 1, 10, 3] = float("nan")
    no_torch_fallback(monkeypatch)
    out, _ = dense_attention.flash_attention_for_cpu(q, k, v, 0.0, True)
    assert out[0, 1, 10].isnan().all()
    assert not out[0, 0].isnan().any() and not out[0, 1, 11].isnan().any()


@pytest.mark.parametrize("case", ["mask", "dropout", "float64", "head dim 64", "few queries", "grad"])
def test_other_calls_take_torch_kernel(case, monkeypatch):
    q, k, v = random_qkv((1, 2, 64, 16), (1, 2, 64, 16), seed=1)
    kwargs, dropout = {}, 0.0
    if case == "mask":
        kwargs["attn_mask"] = torch.zeros(64, 64)
    elif case == "dropout":
        dropout = 0.5
    elif case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "head dim 64":
        q, k, v = random_qkv((1, 2, 64, 64), (1, 2, 64, 64), seed=1)
    elif case == "few queries":
        q = q[:, :, :5]
    elif case == "grad":
        q.requires_grad_(True)
    calls = []
    monkeypatch.setattr(dense_attention, "_aten_flash", lambda *a, **kw: calls.append(a) or "torch")
    assert dense_attention.flash_attention_for_cpu(q, k, v, dropout, False, **kwargs) == "torch" and calls


def test_switched_off_takes_torch_kernel(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    q, k, v = random_qkv((1, 2, 64, 16), (1, 2, 64, 16), seed=2)
    monkeypatch.setattr(dense_attention, "_aten_flash", lambda *a, **kw: "torch")
    assert dense_attention.flash_attention_for_cpu(q, k, v) == "torch"
    assert dense_attention.native_callable() is None


@needs_native
def test_native_callable_takes_flash_calls():
    """What the runtime binds the graph's flash-attention calls to (npu_graph.runtime.direct_calls)."""
    flash = dense_attention.native_callable()
    q, k, v = random_qkv((1, 2, 80, 16), (1, 2, 80, 16), seed=6)
    out, _ = flash(q, k, v, 0.0, True, scale=None)
    torch.testing.assert_close(out, aten_flash(q, k, v, 0.0, True)[0], rtol=1e-5, atol=2e-6)

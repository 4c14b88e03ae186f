"""causal_sdpa: flash attention with a constant causal mask becomes `is_causal=True` (bool and additive masks built
from aranges, as transformers builds them), results equal to eager; masks that are not causal, that read graph
inputs, or non-square attention are left alone."""
import pytest
import torch
import torch.nn.functional as F

from npu_graph.passes import causal_sdpa


def qkv(heads=2, length=16, keys=None, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, length, dim, generator=g)
    k, v = torch.randn(2, 1, heads, keys or length, dim, generator=g)
    return q, k, v


def causal_bool(n, m=None):
    i, j = torch.arange(n), torch.arange(m or n)
    return (j[None, :] <= i[:, None])[None, None]


def attend(mask_kind):
    def fn(q, k, v):
        n, m = q.shape[-2], k.shape[-2]
        mask = causal_bool(n, m)
        if mask_kind == "additive":
            mask = torch.zeros(1, 1, n, m).masked_fill(~mask, float("-inf"))
        elif mask_kind == "not_causal":
            mask = mask.flip(-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 2
    return fn


def flash_calls(watched):
    return watched.after.get("aten._scaled_dot_product_flash_attention_for_cpu.default", 0)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_constant_causal_masks_become_is_causal(watch_pass, kind):
    watched = watch_pass(causal_sdpa, attend(kind), *qkv())
    assert watched.stats["matches"] == {causal_sdpa.PATTERN: 1} and flash_calls(watched) == 1
    assert "aten.le" not in watched.after_names and "aten.arange" not in watched.after_names
    torch.testing.assert_close(watched.out, watched.ref, rtol=1e-5, atol=1e-5)


def test_not_causal_mask_is_a_near_miss(watch_pass):
    watched = watch_pass(causal_sdpa, attend("not_causal"), *qkv())
    assert watched.stats["matches"] == {}
    assert any("not causal" in miss["reason"] for miss in watched.stats["near_misses"])
    torch.testing.assert_close(watched.out, watched.ref, rtol=1e-5, atol=1e-5)


def test_rectangular_attention_is_left_alone(watch_pass):
    """Fewer queries than keys: is_causal aligns its diagonal top-left, model masks usually right-down; the pass
    only rewrites square attention."""
    watched = watch_pass(causal_sdpa, attend("bool"), *qkv(length=4, keys=16))
    assert watched.stats["matches"] == {}
    torch.testing.assert_close(watched.out, watched.ref, rtol=1e-5, atol=1e-5)


def test_mask_from_an_input_is_left_alone(watch_pass):
    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    watched = watch_pass(causal_sdpa, fn, *qkv(), causal_bool(16))
    assert watched.stats["matches"] == {}
    assert any("not a constant" in miss["reason"] for miss in watched.stats["near_misses"])


def test_masks_too_large_to_build_at_compile_time_are_left_alone(watch_pass, monkeypatch):
    monkeypatch.setattr(causal_sdpa, "MAX_MASK_ELEMENTS", 100)
    watched = watch_pass(causal_sdpa, attend("bool"), *qkv())
    assert watched.stats["matches"] == {}
    assert any("built at compile time" in miss["reason"] for miss in watched.stats["near_misses"])

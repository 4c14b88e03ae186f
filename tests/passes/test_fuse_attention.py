"""fuse_attention on the ways models write dense softmax attention: op sets before/after the pass and
equal numerics; sparse attention, softmax over depth and graphs without attention are left alone."""
import math

import pytest
import torch
import torch.nn.functional as F

from npu_graph.passes import fuse_attention

FLASH = "aten._scaled_dot_product_flash_attention_for_cpu.default"
SOFTMAX = "aten._softmax.default"


@pytest.fixture
def ops(watch_pass):
    """Compiles with fuse_attention watched (see conftest.watch_pass)."""
    return lambda fn, *args: watch_pass(fuse_attention, fn, *args)


def run(fn, *args, ops, atol=1e-5):
    watched = ops(fn, *args)
    assert watched.report.fallback is None
    torch.testing.assert_close(watched.out, watched.ref, rtol=atol, atol=atol)
    return watched.stats, watched.before, watched.after


def assert_fused(stats, before, after, count=1):
    assert stats["matches"] == {fuse_attention.PATTERN: count} and stats["near_misses"] == []
    assert before[SOFTMAX] + before["aten._safe_softmax.default"] == count and FLASH not in before
    assert after[FLASH] == count and SOFTMAX not in after and "aten.bmm.default" not in after


def test_matmul_with_scale(ops):
    def attention(q, k, v):
        return F.softmax(q @ k.transpose(-1, -2) * 0.2, dim=-1) @ v

    stats, before, after = run(attention, torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8),
                               torch.randn(2, 3, 7, 8), ops=ops)
    assert before["aten.bmm.default"] == 2
    assert_fused(stats, before, after)


def test_einsum_with_additive_mask_and_division(ops):
    def attention(q, k, v, mask):
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
        return torch.einsum("bhts,bshd->bthd", torch.softmax(scores + mask, dim=-1), v)

    t, s = 5, 9
    mask = torch.zeros(t, s).masked_fill(torch.ones(t, s, dtype=torch.bool).triu(s - t + 1), float("-inf"))
    stats, before, after = run(attention, torch.randn(2, t, 4, 16), torch.randn(2, s, 4, 16),
                               torch.randn(2, s, 4, 16), mask, ops=ops)
    assert_fused(stats, before, after)


def repeat_kv(x, groups):
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)


def gqa(q, k, v, padding):
    """Llama-style eager attention: repeat_kv, causal + left-padding bool mask as masked_fill, fp32 softmax."""
    groups = q.shape[1] // k.shape[1]
    t, s = q.shape[2], k.shape[2]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])
    keys = torch.arange(s)
    visible = (keys <= torch.arange(s - t, s)[:, None]) & (keys >= padding[:, None, None])
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def gqa_inputs(dtype=torch.float32, t=6, s=9):
    torch.manual_seed(0)
    return [torch.randn(2, 4, t, 8, dtype=dtype), torch.randn(2, 2, s, 8, dtype=dtype),
            torch.randn(2, 2, s, 8, dtype=dtype), torch.tensor([0, 2])]


def test_gqa_repeat_kv_with_bool_mask(ops):
    stats, before, after = run(gqa, *gqa_inputs(), ops=ops)
    assert_fused(stats, before, after)


def test_gqa_in_bf16_with_casts_around_the_softmax(ops):
    stats, before, after = run(gqa, *gqa_inputs(torch.bfloat16), ops=ops, atol=2e-2)
    assert before["aten._to_copy.default"] >= 2
    assert_fused(stats, before, after)


def test_symbolic_sequence_lengths(ops):
    inputs = gqa_inputs()
    for x in inputs[:3]:
        torch._dynamo.mark_dynamic(x, 2)
    stats, before, after = run(gqa, *inputs, ops=ops)
    assert_fused(stats, before, after)


def test_decode_with_where_mask(ops):
    def decode(q, k, v, visible):
        scores = torch.einsum("bhd,bshd->bhs", q, k) * 0.25
        probs = torch.where(visible[:, None], scores, float("-inf")).softmax(-1)
        return torch.einsum("bhs,bshd->bhd", probs, v)

    visible = torch.arange(11) < torch.tensor([[7], [11]])
    stats, before, after = run(decode, torch.randn(2, 4, 16), torch.randn(2, 11, 4, 16), torch.randn(2, 11, 4, 16),
                               visible, ops=ops)
    assert_fused(stats, before, after)


def test_different_qk_and_v_head_dims_are_padded(ops):
    def mla_dense(q, k, v):
        probs = (torch.einsum("bthd,bshd->bhts", q, k) * 0.3).softmax(-1)
        return torch.einsum("bhts,bshd->bthd", probs, v)

    stats, before, after = run(mla_dense, torch.randn(2, 5, 3, 24), torch.randn(2, 7, 3, 24),
                               torch.randn(2, 7, 3, 16), ops=ops)
    assert_fused(stats, before, after)
    assert after["aten.constant_pad_nd.default"] == 1


def test_padded_output_keeps_the_layout_later_views_need(ops):
    """Kimi Linear's MLA decode: [B,H,T,Dv] P·V, transposed and `view`ed flat; the padded fused output is
    sliced back to Dv and must be contiguous again, or that view fails at compile time."""
    def mla_then_view(q, k, v):
        probs = (q @ k.transpose(-1, -2) * 0.3).softmax(-1)
        return (probs @ v).transpose(1, 2).reshape(1, -1)

    stats, before, after = run(mla_then_view, torch.randn(1, 4, 1, 24), torch.randn(1, 4, 9, 24),
                               torch.randn(1, 4, 9, 16), ops=ops)
    assert_fused(stats, before, after)


def test_sdpa_math_decomposition_with_safe_softmax(ops):
    def sdpa(q, k, v):  # different head dims: SDPA decomposes into matmuls and _safe_softmax at capture
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    stats, before, after = run(sdpa, torch.randn(1, 2, 6, 24), torch.randn(1, 2, 6, 24), torch.randn(1, 2, 6, 16),
                               ops=ops)
    assert_fused(stats, before, after)


def test_nothing_to_fuse_is_unchanged(ops):
    def mlp(x, w1, w2):
        return F.silu(x @ w1) @ w2 + x.softmax(-1)

    stats, before, after = run(mlp, torch.randn(4, 8), torch.randn(8, 16), torch.randn(16, 8), ops=ops)
    assert stats == {"matches": {}, "near_misses": []} and before == after


def test_relative_position_term_is_a_near_miss(ops):
    def relative(q, k, v, r):
        scores = q @ k.transpose(-1, -2) + q @ r.transpose(-1, -2)
        return scores.softmax(-1) @ v

    x = torch.randn(2, 3, 5, 8)
    stats, before, after = run(relative, x, torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8),
                               torch.randn(2, 3, 7, 8), ops=ops)
    assert stats["matches"] == {} and before == after
    assert [m["reason"] for m in stats["near_misses"]] == ["the softmax input is not c·q·kᵀ (+ masks)"]


def test_softmax_over_depth_is_not_attention_nor_a_near_miss(ops):
    def attn_res(values, query):
        logits = torch.einsum("d,nbtd->nbt", query, F.normalize(values, dim=-1))
        return torch.einsum("nbt,nbtd->btd", logits.softmax(0), values)

    stats, before, after = run(attn_res, torch.randn(3, 2, 5, 8), torch.randn(8), ops=ops)
    assert stats == {"matches": {}, "near_misses": []} and before == after


def test_scatter_built_sparse_mask_is_left_to_fuse_sparse_attention(ops):
    def sparse(q, k, v, topk):
        scores = torch.einsum("bhtd,bsd->bhts", q, k)
        mask = scores.new_full((2, q.shape[2], k.shape[1]), float("-inf")).scatter(-1, topk, 0.0)
        return F.softmax(scores + mask.unsqueeze(1), dim=-1) @ v

    stats, before, after = run(sparse, torch.randn(2, 4, 3, 8), torch.randn(2, 12, 8), torch.randn(2, 4, 12, 8),
                               torch.randint(0, 12, (2, 3, 5)), ops=ops)
    assert stats == {"matches": {}, "near_misses": []} and before == after


def test_tiny_transformers_llama_with_eager_attention(ops):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0
    stats, before, after = run(lambda i, m: model(i, attention_mask=m).logits, ids, mask, ops=ops,
                               atol=1e-4)
    assert_fused(stats, before, after, count=2)

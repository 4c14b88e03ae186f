"""absorb_mla: expanded top-k sparse MLA (per-head keys/values from kv_b_proj) becomes the absorbed form, which
fuse_sparse_attention then turns into sparse_flash_attention; dense MLA is absorbed over a few query rows (decode)
and left alone over many (prefill)."""
import pytest
import torch

from npu_graph.passes import absorb_mla, fuse_sparse_attention

HEADS, NOPE, ROPE, VALUE, LATENT, TOPK = 4, 16, 8, 12, 32, 6


def expanded_mla(q, latent, k_rope, w_kvb, topk, *, use_split: bool, mask_form: str):
    """Expanded MLA over a top-k mask, written the way transformers and most MLA code write it."""
    batch, seq = latent.shape[0], latent.shape[1]
    kv = (latent @ w_kvb.t()).view(batch, seq, HEADS, NOPE + VALUE).transpose(1, 2)
    if use_split:
        k_nope, value = torch.split(kv, [NOPE, VALUE], dim=-1)
        key = torch.cat([k_nope, k_rope.expand(-1, HEADS, -1, -1)], dim=-1)
    else:
        k_nope, value = kv[..., :NOPE], kv[..., NOPE:]
        key = kv.new_empty(batch, HEADS, seq, NOPE + ROPE)
        key[..., :NOPE].copy_(k_nope)
        key[..., NOPE:].copy_(k_rope.expand(-1, HEADS, -1, -1))
    rows = torch.arange(q.shape[2])[:, None] + seq - q.shape[2]
    causal = torch.arange(seq)[None, :] <= rows
    dropped = torch.ones(batch, q.shape[2], seq, dtype=torch.bool).scatter(-1, topk, False).unsqueeze(1)
    if mask_form == "bool":
        mask = torch.where(causal & ~dropped, 0.0, float("-inf"))
    else:
        additive = torch.zeros(causal.shape).masked_fill(~causal, torch.finfo(torch.float32).min)
        mask = additive.masked_fill(dropped, torch.finfo(torch.float32).min)
    scores = torch.matmul(q, key.transpose(2, 3)) * (NOPE + ROPE) ** -0.5 + mask
    return torch.matmul(torch.softmax(scores, dim=-1), value)


def inputs(seq: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, rows, NOPE + ROPE, generator=g)
    latent = torch.randn(1, seq, LATENT, generator=g)
    k_rope = torch.randn(1, 1, seq, ROPE, generator=g)
    w_kvb = torch.randn(HEADS * (NOPE + VALUE), LATENT, generator=g) / LATENT ** 0.5
    visible = torch.arange(seq)[None, :] <= (torch.arange(rows)[:, None] + seq - rows)
    noise = torch.rand(1, rows, seq, generator=g).masked_fill(~visible, -1.0)
    topk = noise.topk(min(TOPK, seq), dim=-1).indices
    return q, latent, k_rope, w_kvb, topk


@pytest.mark.parametrize("use_split", [True, False])
@pytest.mark.parametrize("mask_form", ["bool", "masked_fill"])
@pytest.mark.parametrize("seq,rows", [(20, 20), (20, 1), (4, 4)])
def test_expanded_mla_is_absorbed_and_fused(watch_pass, use_split, mask_form, seq, rows):
    def fn(*args):
        return expanded_mla(*args, use_split=use_split, mask_form=mask_form)

    run = watch_pass(absorb_mla, fn, *inputs(seq, rows))
    assert run.stats["matches"] == {absorb_mla.PATTERN: 1}
    assert run.report.fused_ops.get("sparse_flash_attention") == 1
    assert "aten.slice_scatter" not in run.after_names
    torch.testing.assert_close(run.out, run.ref, rtol=1e-4, atol=1e-5)


def dense_mla(q, latent, k_rope, w_kvb, _):
    kv = (latent @ w_kvb.t()).view(1, latent.shape[1], HEADS, NOPE + VALUE).transpose(1, 2)
    k_nope, value = torch.split(kv, [NOPE, VALUE], dim=-1)
    key = torch.cat([k_nope, k_rope.expand(-1, HEADS, -1, -1)], dim=-1)
    return torch.softmax(q @ key.transpose(2, 3) * (NOPE + ROPE) ** -0.5, dim=-1) @ value


def test_dense_mla_over_many_query_rows_is_left_alone(watch_pass):
    """40 query rows: attending over the latent (40·(2·32+8) per key and head) costs more than projecting it
    (32·(16+12))."""
    run = watch_pass(absorb_mla, dense_mla, *inputs(40, 40))
    assert run.stats["matches"] == {} and run.stats["near_misses"] == []
    assert run.before == run.after


@pytest.mark.parametrize("rows", [1, 4])
def test_dense_mla_over_a_few_query_rows_is_absorbed(watch_pass, rows):
    """A decode step (or a few drafted tokens): no per-step projection of every cached latent."""
    run = watch_pass(absorb_mla, dense_mla, *inputs(30, rows))
    assert run.stats["matches"] == {absorb_mla.PATTERN: 1}
    assert run.before["aten.mm.default"] == 1 and "aten.mm" not in run.after_names and "aten.cat" not in run.after_names
    assert run.report.near_misses() == []       # fuse_attention leaves the absorbed form alone, quietly
    torch.testing.assert_close(run.out, run.ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_transformers_deepseek_v32_prefill_and_decode(watch_pass, tiny_transformers, attn_implementation):
    model = tiny_transformers("deepseek_v32", attn_implementation=attn_implementation)
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(1))

    def prefill_then_decode(ids):
        out = model(ids[:, :-1], use_cache=True)
        step = model(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
        return out.logits, step.logits

    run = watch_pass(fuse_sparse_attention, prefill_then_decode, ids)
    layers = model.config.num_hidden_layers
    fused = [r.fused_ops.get("sparse_flash_attention", 0) for r in [run.report]]
    assert sum(fused) >= layers
    for out, ref in zip(run.out, run.ref):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())

"""fuse_sparse_attention on the two ways models restrict MLA attention to top-k keys: gathered rows
(decode, and a few tokens folded into the batch, paged cache) and a scatter-built -inf mask over dense attention
(prefill)."""
import torch
import torch.nn.functional as F

import npu_graph
from npu_graph.passes import fuse_sparse_attention

B, H, C, R, BLOCK, BLOCKS, K = 2, 4, 32, 8, 4, 6, 5
S = BLOCK * BLOCKS


def run(fn, *args):
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False}))
    with torch.no_grad():
        ref = fn(*args)
        out = torch.compile(fn, backend=backend)(*args)
    report = backend.reports[-1]
    stats = next(p["stats"] for p in report.passes if p["name"] == fuse_sparse_attention.NAME)
    return ref, out, report, stats


def paged_inputs(seed=0):
    torch.manual_seed(seed)
    table = torch.randperm(B * BLOCKS).view(B, BLOCKS).to(torch.int32)
    latent, rope = torch.randn(B * BLOCKS, BLOCK, 1, C), torch.randn(B * BLOCKS, BLOCK, 1, R)
    return table, latent, rope


def decode(q, qr, selected, position, table, latent, rope):
    blocks = table.long().gather(1, selected // BLOCK)
    offsets = selected % BLOCK
    keys, key_rope = latent[blocks, offsets].squeeze(-2), rope[blocks, offsets].squeeze(-2)
    scores = (torch.einsum("bhc,bkc->bhk", q[:, 0], keys) + torch.einsum("bhr,bkr->bhk", qr[:, 0], key_rope)) * 0.3
    scores = scores.masked_fill(~(selected <= position).unsqueeze(1), float("-inf"))
    return torch.einsum("bhk,bkc->bhc", F.softmax(scores, dim=-1), keys).unsqueeze(1)


def test_decode_gather_form_with_paged_cache():
    table, latent, rope = paged_inputs()
    position = torch.tensor([[9], [20]])
    selected = torch.stack([torch.randperm(S)[:K] for _ in range(B)])
    selected[:, 0] = 0
    q, qr = torch.randn(B, 1, H, C), torch.randn(B, 1, H, R)
    ref, out, report, stats = run(decode, q, qr, selected, position, table, latent, rope)
    assert report.fused_ops == {"sparse_flash_attention": 1}, stats
    assert list(stats["matches"]) == [fuse_sparse_attention.PATTERN_GATHER]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def folded(q, qr, selected, positions, table, latent, rope):
    """A step of T tokens per sequence as B·T decode rows: [B, T·K] gathered rows viewed as [B·T, K]."""
    batch, t, k = selected.shape
    flat = selected.reshape(batch, t * k)
    blocks, offsets = table.long().gather(1, flat // BLOCK), flat % BLOCK
    keys = latent[blocks, offsets].squeeze(-2).view(batch * t, k, C)
    key_rope = rope[blocks, offsets].squeeze(-2).view(batch * t, k, R)
    scores = (torch.einsum("bhc,bkc->bhk", q.flatten(0, 1), keys)
              + torch.einsum("bhr,bkr->bhk", qr.flatten(0, 1), key_rope)) * 0.3
    visible = flat.view(batch * t, k) <= positions.reshape(batch * t, 1)
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    return torch.einsum("bhk,bkc->bhc", F.softmax(scores, dim=-1), keys).view(batch, t, H, C)


def test_tokens_folded_into_the_batch_read_their_sequences_blocks():
    table, latent, rope = paged_inputs(2)
    t = 3
    positions = torch.tensor([[4, 5, 6], [17, 18, 19]])      # ragged: each token sees up to its own position
    selected = torch.stack([torch.stack([torch.randperm(S)[:K] for _ in range(t)]) for _ in range(B)])
    selected[:, :, 0] = 0
    q, qr = torch.randn(B, t, H, C), torch.randn(B, t, H, R)
    ref, out, report, stats = run(folded, q, qr, selected, positions, table, latent, rope)
    assert report.fused_ops == {"sparse_flash_attention": 1}, stats
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def straddling(q, qr, selected, position, table, latent, rope):
    """[B, N] gathered rows viewed as rows of a length that does not divide N: a row mixes two sequences."""
    blocks, offsets = table.long().gather(1, selected // BLOCK), selected % BLOCK
    rows = selected.numel() // 4
    keys = latent[blocks, offsets].squeeze(-2).view(rows, 4, C)
    key_rope = rope[blocks, offsets].squeeze(-2).view(rows, 4, R)
    scores = (torch.einsum("bhc,bkc->bhk", q, keys) + torch.einsum("bhr,bkr->bhk", qr, key_rope)) * 0.3
    scores = scores.masked_fill(~(selected.view(rows, 4) <= position).unsqueeze(1), float("-inf"))
    return torch.einsum("bhk,bkc->bhc", F.softmax(scores, dim=-1), keys)


def test_rows_straddling_two_sequences_are_not_fused():
    table, latent, rope = paged_inputs(3)
    selected = torch.stack([torch.randperm(S)[:6] for _ in range(B)])
    q, qr, position = torch.randn(3, H, C), torch.randn(3, H, R), torch.tensor([[20], [21], [22]])
    ref, out, report, stats = run(straddling, q, qr, selected, position, table, latent, rope)
    assert "sparse_flash_attention" not in report.fused_ops, stats
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def prefill(q, qr, topk, table, latent, rope):
    keys = latent[table.long()].reshape(B, S, C)
    key_rope = rope[table.long()].reshape(B, S, R)
    scores = (torch.einsum("bthc,bsc->bhts", q, keys) + torch.einsum("bthr,bsr->bhts", qr, key_rope)) * 0.3
    t = q.shape[1]
    index_mask = scores.new_full((B, t, S), float("-inf")).scatter(-1, topk, 0.0)
    visible = torch.arange(S) <= torch.arange(S - t, S).unsqueeze(-1)
    causal = torch.zeros(B, t, S).masked_fill(~visible, float("-inf"))
    probs = F.softmax(scores + (index_mask + causal).unsqueeze(1), dim=-1)
    return torch.einsum("bhts,bsc->bthc", probs, keys)


def test_prefill_mask_form():
    table, latent, rope = paged_inputs(1)
    t = 7
    topk = torch.stack([torch.stack([torch.randperm(S - t + i + 1)[:K] for i in range(t)]) for _ in range(B)])
    q, qr = torch.randn(B, t, H, C), torch.randn(B, t, H, R)
    ref, out, report, stats = run(prefill, q, qr, topk, table, latent, rope)
    assert report.fused_ops == {"causal_lengths": 1, "sparse_flash_attention": 1}, stats
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_dense_attention_is_not_touched_and_not_a_near_miss():
    def dense(q, k, v):
        return F.softmax(q @ k.transpose(-1, -2) * 0.2, dim=-1) @ v

    ref, out, report, stats = run(dense, torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8))
    assert report.fused_ops == {} and stats["near_misses"] == []
    torch.testing.assert_close(out, ref)


def test_sparse_mask_with_separate_values_is_a_near_miss():
    def per_head_values(q, k, v, topk):
        scores = torch.einsum("bhtd,bsd->bhts", q, k)
        mask = scores.new_full((B, q.shape[2], S), float("-inf")).scatter(-1, topk, 0.0)
        return F.softmax(scores + mask.unsqueeze(1), dim=-1) @ v

    t = 3
    topk = torch.randint(0, S, (B, t, K))
    ref, out, report, stats = run(per_head_values, torch.randn(B, H, t, C), torch.randn(B, S, C),
                                  torch.randn(B, H, S, C), topk)
    assert report.fused_ops == {} and torch.equal(out, ref)
    assert "MLA absorbed form" in stats["near_misses"][0]["reason"]

"""fuse_lightning_indexer on the formulations people write: op sets before/after and equal top-k sets."""
import pytest
import torch
import torch.nn.functional as F

import npu_graph
from npu_graph.passes import fuse_lightning_indexer

B, T, H, D, S, K = 2, 6, 4, 16, 24, 8


def run(fn, *args, dynamic=None):
    """Eager and compiled results plus the graph report (fused_ops, pass stats)."""
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False}))
    with torch.no_grad():
        ref = fn(*args)
        out = torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    report = backend.reports[-1]
    stats = next(p["stats"] for p in report.passes if p["name"] == fuse_lightning_indexer.NAME)
    return ref, out, report, stats


def visible_sets(indices, visible):
    """Top-k indices per row restricted to visible keys (masked picks are arbitrary in eager)."""
    rows = indices.reshape(-1, indices.shape[-1]).tolist()
    vis = visible.expand(*indices.shape[:-1], visible.shape[-1]).reshape(len(rows), -1)
    return [{i for i in row if 0 <= i < vis.shape[1] and vis[r, i]} for r, row in enumerate(rows)]


def causal(positions):
    return torch.arange(S) <= positions.unsqueeze(-1)


def inputs(t=T):
    torch.manual_seed(0)
    positions = torch.arange(S - t, S).expand(B, t)
    return torch.randn(B, t, H, D), torch.randn(B, S, D), torch.randn(B, t, H), positions


def reference_style(q, k, w, positions):
    scores = torch.einsum("bthd,bsd->bths", q, k).relu()
    index_scores = (scores * w.unsqueeze(-1)).sum(dim=2)
    index_scores = index_scores.masked_fill(~causal(positions), float("-inf"))
    return index_scores.topk(K, dim=-1).indices


def transformers_style(q, k, w, positions):
    mask = torch.zeros(B, 1, q.shape[1], S).masked_fill(~causal(positions).unsqueeze(1), torch.finfo(torch.float32).min)
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * D ** -0.5
    scores = F.relu(scores.transpose(2, 2))
    weights = w.float() * H ** -0.5
    index_scores = torch.matmul(weights.unsqueeze(-2), scores.transpose(2, 3).transpose(2, 3)).squeeze(-2)
    index_scores = index_scores + mask[:, 0]
    return index_scores.topk(K, dim=-1).indices.to(torch.int32)


def deepseek_reference_style(q, k, w, positions):
    score = torch.einsum("bshd,btd->bsht", q, k)
    score = (score.relu_() * w[..., None]).sum(dim=2) * 0.5
    score = torch.where(causal(positions), score, torch.full_like(score, float("-inf")))
    return score.topk(K, dim=-1)[1]


def check(fn, t=T, dynamic=False):
    q, k, w, positions = inputs(t)
    ref, out, report, stats = run(fn, q, k, w, positions, dynamic=dynamic or None)
    assert report.fused_ops.get("lightning_indexer") == 1, stats
    assert out.dtype == ref.dtype and out.shape == ref.shape
    visible = causal(positions)
    assert visible_sets(out, visible) == visible_sets(ref, visible)
    return report


def test_reference_model_formulation():
    report = check(reference_style)
    assert report.fused_ops == {"causal_lengths": 1, "lightning_indexer": 1}


def test_transformers_formulation_with_additive_mask_and_casts():
    check(transformers_style)


def test_deepseek_reference_formulation_with_where_mask():
    check(deepseek_reference_style)


def test_decode_without_mask():
    def decode(q, k, w, positions):
        return ((torch.einsum("bthd,bsd->bths", q, k).relu() * w[..., None]).sum(2)).topk(K).indices

    q, k, w, positions = inputs(1)
    ref, out, report, _ = run(decode, q, k, w, positions)
    assert report.fused_ops == {"lightning_indexer": 1}
    assert [set(r) for r in out.reshape(-1, K).tolist()] == [set(r) for r in ref.reshape(-1, K).tolist()]


def test_symbolic_sequence_length():
    report = check(reference_style, dynamic=True)
    assert any(p["name"] == "fuse_lightning_indexer" and p["changed"] for p in report.passes)


def test_paged_cache_is_read_in_place():
    blocks, block = 6, 4
    table = torch.randperm(B * blocks).view(B, blocks).to(torch.int32)

    def paged(q, cache, w, positions):
        keys = cache[table.long()].reshape(B, blocks * block, D)
        return reference_style(q, keys, w, positions)

    q, _, w, positions = inputs()
    cache = torch.randn(B * blocks, block, 1, D)
    ref, out, report, _ = run(paged, q, cache, w, positions)
    assert report.fused_ops.get("lightning_indexer") == 1
    visible = causal(positions)
    assert visible_sets(out, visible) == visible_sets(ref, visible)


def test_plain_topk_is_left_alone_and_not_a_near_miss():
    def router(x):
        return x.softmax(-1).topk(2).indices

    ref, out, report, stats = run(router, torch.randn(8, 16))
    assert report.fused_ops == {} and stats["near_misses"] == [] and torch.equal(ref, out)


def test_negative_scale_inside_relu_is_a_near_miss():
    def flipped(q, k, w, positions):
        scores = (torch.einsum("bthd,bsd->bths", q, k) * -1.0).relu()
        return (scores * w.unsqueeze(-1)).sum(dim=2).topk(K).indices

    q, k, w, positions = inputs()
    ref, out, report, stats = run(flipped, q, k, w, positions)
    assert report.fused_ops == {} and torch.equal(ref, out)
    assert "non-positive scale" in stats["near_misses"][0]["reason"]


def test_non_causal_mask_falls_back_to_eager_at_run_time():
    def strided(q, k, w, positions):
        scores = (torch.einsum("bthd,bsd->bths", q, k).relu() * w.unsqueeze(-1)).sum(dim=2)
        keep = (torch.arange(S) % 2 == 0).expand_as(scores)
        return scores.masked_fill(~keep, float("-inf")).topk(K).indices

    q, k, w, positions = inputs()
    with pytest.warns(npu_graph.backend.CompilationFallbackWarning, match="not right-down causal"):
        ref, out, report, _ = run(strided, q, k, w, positions)
    assert report.fused_ops.get("lightning_indexer") == 1 and torch.equal(ref, out)


def _min_count_decode(q, k, w, positions):
    """DSA decode as transformers' deepseek_v32 writes it: top-k of min(index_topk, number of keys)."""
    scores = (torch.einsum("bthd,bsd->bths", q, k).relu() * w[..., None]).sum(2)
    return scores.topk(min(K, scores.shape[-1]), dim=-1).indices


@pytest.mark.parametrize("keys", [5, 24])
def test_symbolic_count_min_of_topk_and_cache_length(keys):
    """A symbolic count min(K, S2) fuses (sparse_count K, result sliced to the count), whether the cache holds
    fewer keys than K or more; one graph serves both."""
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False}))
    compiled = torch.compile(_min_count_decode, backend=backend, dynamic=True)
    torch.manual_seed(0)
    for n in (keys + 1, keys):
        q, k, w = torch.randn(B, 1, H, D), torch.randn(B, n, D), torch.randn(B, 1, H)
        with torch.no_grad():
            ref, out = _min_count_decode(q, k, w, None), compiled(q, k, w, None)
        assert out.shape == ref.shape
        assert [set(r) for r in out.reshape(B, -1).tolist()] == [set(r) for r in ref.reshape(B, -1).tolist()]
    assert len(backend.reports) == 1
    assert backend.reports[0].fused_ops == {"lightning_indexer": 1}


def test_additive_mask_with_fewer_dims_than_the_score_broadcasts():
    """DeepSeek-V3.2's inference code adds a [S, T] causal mask to the [B, S, T] score (`index_score += mask`)."""
    def inference_style(q, k, w, positions):
        score = (torch.einsum("bshd,btd->bsht", q, k).relu() * w[..., None]).sum(dim=2)
        mask = torch.full((q.shape[1], S), float("-inf")).triu_(S - q.shape[1] + 1)
        score += mask
        return score.topk(min(K, S), dim=-1)[1]

    report = check(inference_style)
    assert report.fused_ops == {"causal_lengths": 1, "lightning_indexer": 1}

"""ascend_dsa::lightning_indexer: fast CPU path against the fp32 reference (top-K compared as sets, scores
as values), paged vs BSND, sequence lengths, -1 padding, MXFP8, errors, a property test of the definition,
and the op inside torch.compile."""
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native_paths import native_and_torch

from npu_graph.kernels.indexer import checks as indexer_checks
from npu_graph.kernels.indexer import keys as indexer_keys
from npu_graph.kernels.indexer import lightning_indexer as li
from npu_graph.kernels.indexer import topk as indexer_topk
from npu_graph.kernels.native import loader as native

OP = torch.ops.ascend_dsa.lightning_indexer
path = native_and_torch(li.lightning_indexer_native.NATIVE_SOURCE)


def make_inputs(batch, s1, n1, d, s2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, s1, n1, d, generator=g).to(dtype)
    k = torch.randn(batch, s2, 1, d, generator=g).to(dtype)
    w = torch.randn(batch, s1, n1, generator=g)
    return q, k, w


def to_paged(key, block_size, seed=0, shuffled=True):
    """The same keys in a paged cache with a shuffled (or in-order) block order, one spare block, and the block
    table."""
    batch, s2, _, d = key.shape
    per_batch = math.ceil(s2 / block_size)
    padded = torch.zeros(batch, per_batch * block_size, 1, d, dtype=key.dtype)
    padded[:, :s2] = key
    blocks = padded.view(batch * per_batch, block_size, 1, d)
    order = torch.randperm(batch * per_batch + 1, generator=torch.Generator().manual_seed(seed)) if shuffled \
        else torch.arange(batch * per_batch + 1)
    cache = torch.randn(batch * per_batch + 1, block_size, 1, d).to(key.dtype)
    cache[order[:batch * per_batch]] = blocks
    return cache, order[:batch * per_batch].view(batch, per_batch).to(torch.int32)


def assert_same_topk(got, want, rtol=1e-5, atol=1e-4):
    """Scores equal as sorted values, -1 in the same places, and indices equal as sets per row except for
    keys tied with the last kept score (with few heads many keys score exactly 0)."""
    (gi, gv), (wi, wv) = got, want
    assert gi.dtype == torch.int32 and gv.dtype == torch.float32
    assert gi.shape == wi.shape and gv.shape == wv.shape
    assert torch.equal(gi == -1, wi == -1)
    assert torch.equal(torch.isinf(gv), torch.isinf(wv))
    finite = torch.isfinite(wv)
    torch.testing.assert_close(gv[finite], wv[finite], rtol=rtol, atol=atol)
    for ig, vg, iw, vw in zip(gi.flatten(0, 2), gv.flatten(0, 2), wi.flatten(0, 2), wv.flatten(0, 2)):
        if torch.isfinite(vw).any():
            above = vw[torch.isfinite(vw)].min() + atol + rtol * vw.abs().max()
            assert set(ig[vg > above].tolist()) == set(iw[vw > above].tolist())


def scores_of(q, k, w):
    """Brute force score[b,t,s] for BSND inputs, fp32."""
    dots = torch.einsum("btjd,bsd->btjs", q.float(), k[:, :, 0].float())
    return (dots.relu() * w.float()[..., None]).sum(2)


CASES = [  # batch, s1, n1, d, s2, k, sparse_mode
    (2, 1, 8, 64, 700, 64, 3),      # decode, streamed over several chunks
    (2, 37, 4, 32, 37, 16, 3),      # prefill, causal square
    (1, 5, 4, 32, 300, 50, 3),      # a few queries at the end of a longer context
    (2, 6, 4, 16, 90, 20, 0),       # no mask
    (1, 4, 2, 16, 10, 32, 3),       # fewer visible keys than sparse_count: -1 padding
    (2, 3, 8, 64, 9000, 300, 3),    # chunks of 4096 with a running top-K
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case, dtype):
    batch, s1, n1, d, s2, k, mode = case
    q, key, w = make_inputs(batch, s1, n1, d, s2, dtype)
    got = OP(q, key, w, sparse_count=k, sparse_mode=mode)
    assert_same_topk(got, li.reference_lightning_indexer(q, key, w, sparse_count=k, sparse_mode=mode))


@pytest.mark.parametrize("batch,s1,s2,k", [(1, 1, 16384, 2048), (3, 1, 3000, 256), (1, 3, 5000, 512)])
def test_bf16_prefilter_matches_reference(batch, s1, s2, k, monkeypatch):
    monkeypatch.setattr(li, "bf16_prefilter", lambda: True)   # checked on any CPU, however slow its bf16 GEMM
    monkeypatch.setenv(native.ENV_SWITCH, "0")        # the native scores would take these rows
    q, key, w = make_inputs(batch, s1, 16, 64, s2, torch.bfloat16, seed=1)
    got = OP(q, key, w, sparse_count=k, sparse_mode=0)
    assert_same_topk(got, li.reference_lightning_indexer(q, key, w, sparse_count=k, sparse_mode=0))


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])
def test_prefilter_margin_bounds_the_bf16_error(weights_dtype):
    """The law the prefilter rests on: |A − score| <= e for every key (A, e from the bf16 GEMMs)."""
    q, key, w = make_inputs(1, 1, 16, 64, 5000, torch.bfloat16, seed=3)
    w = (w * 3).to(weights_dtype)
    reader = indexer_keys.KeyReader(key, None, None)
    approx, margin = indexer_topk.approx_scores(reader, 0, q[0, 0], w[0, 0].float(), 5000)
    score = scores_of(q, key, w)[0, 0]
    assert ((approx - score).abs() <= margin + 1e-4).all()
    assert (margin > 0).float().mean() > 0.9


def test_prefilter_is_exact_with_near_ties(monkeypatch):
    """Keys that differ by less than the bf16 rounding of their scores: the prefilter keeps every key that
    might belong to the top K and the exact pass orders them, so the scores equal the reference."""
    monkeypatch.setattr(li, "bf16_prefilter", lambda: True)
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    q, key, w = make_inputs(1, 1, 8, 64, 4000, torch.bfloat16, seed=2)
    base = torch.randn(1, 1, 1, 64).bfloat16()
    key[:, 1000:3000] = base + (torch.randn(1, 2000, 1, 64) * 0.02).bfloat16()
    w = w.abs()
    got = OP(q, key, w, sparse_count=600)
    ref = li.reference_lightning_indexer(q, key, w, sparse_count=600)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-4)
    score = scores_of(q, key, w)[0, 0]
    torch.testing.assert_close(score[got[0][0, 0, 0].long()], got[1][0, 0, 0], rtol=1e-5, atol=1e-4)


def test_torch_paths_under_onednn_limited_to_avx2():
    """A user's ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN refuse bf16 products on a CPU that has AVX512-BF16: the
    torch paths of both ops then use fp32 products instead of failing (a fresh process: oneDNN reads the
    variable once)."""
    program = """
import torch, npu_graph
from npu_graph.kernels.indexer import keys as indexer_keys, lightning_indexer as li
assert not indexer_keys.onednn_bf16()
g = torch.Generator().manual_seed(0)
q = torch.randn(1, 1, 16, 64, generator=g).bfloat16()
key = torch.randn(1, 5000, 1, 64, generator=g).bfloat16()
w = torch.randn(1, 1, 16, generator=g).bfloat16()
got = torch.ops.ascend_dsa.lightning_indexer(q, key, w, sparse_count=512)
ref = li.reference_lightning_indexer(q, key, w, sparse_count=512)
torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-4)
print("ok")
"""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", native.ENV_SWITCH: "0"}
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,shuffled", [(16, True), (128, True), (128, False)])
def test_paged_equals_bsnd(dtype, block_size, shuffled):
    q, key, w = make_inputs(3, 2, 8, 64, 3100, dtype, seed=3)
    lengths = torch.tensor([3100, 1500, 7], dtype=torch.int32)
    cache, table = to_paged(key, block_size, seed=4, shuffled=shuffled)
    paged = OP(q, cache, w, actual_seq_lengths_key=lengths, block_table=table, layout_key="PA_BSND",
               sparse_count=256)
    bsnd = OP(q, key, w, actual_seq_lengths_key=lengths, sparse_count=256)
    assert torch.equal(paged[0], bsnd[0]) and torch.equal(paged[1], bsnd[1])
    ref = li.reference_lightning_indexer(q, cache, w, actual_seq_lengths_key=lengths, block_table=table,
                                         layout_key="PA_BSND", sparse_count=256)
    assert_same_topk(paged, ref)


def test_paged_default_key_length_is_table_capacity():
    q, key, w = make_inputs(2, 1, 4, 32, 64, seed=5)
    cache, table = to_paged(key, 16)
    got = OP(q, cache, w, block_table=table, layout_key="PA_BSND", sparse_count=70, sparse_mode=0)
    assert_same_topk(got, OP(q, key, w, sparse_count=70, sparse_mode=0))
    assert (got[0] >= 0).sum(-1).flatten().tolist() == [64, 64]


def test_actual_sequence_lengths():
    q, key, w = make_inputs(2, 6, 4, 32, 50, seed=6)
    lq = torch.tensor([6, 2], dtype=torch.int64)
    lk = torch.tensor([50, 20], dtype=torch.int32)
    idx, val = OP(q, key, w, actual_seq_lengths_query=lq, actual_seq_lengths_key=lk, sparse_count=8)
    assert (idx[1, 2:] == -1).all() and torch.isinf(val[1, 2:]).all()
    # batch 1: two real queries at the end of 20 keys see keys <= 18 and <= 19
    assert idx[1, 0].max() <= 18 and idx[1, 1].max() <= 19 and (idx[1, :2] >= 0).all()
    want = OP(q[1:, :2], key[1:, :20], w[1:, :2], sparse_count=8)
    assert_same_topk((idx[1:, :2], val[1:, :2]), want)
    ref = li.reference_lightning_indexer(q, key, w, actual_seq_lengths_query=lq, actual_seq_lengths_key=lk,
                                         sparse_count=8)
    assert_same_topk((idx, val), ref)


def test_causal_padding_counts():
    """Square causal prefill: query t sees t + 1 keys; the rest of its row is -1 / -inf."""
    q, key, w = make_inputs(1, 10, 4, 16, 10, seed=7)
    idx, val = OP(q, key, w, sparse_count=16)
    assert (idx >= 0).sum(-1).flatten().tolist() == list(range(1, 11))
    assert torch.equal(idx == -1, torch.isinf(val))
    for t in range(10):
        assert sorted(idx[0, t, 0, :t + 1].tolist()) == list(range(t + 1))
        assert (val[0, t, 0, :t + 1].diff() <= 0).all()


def test_more_queries_than_keys_sees_nothing_early():
    q, key, w = make_inputs(1, 8, 4, 16, 5, seed=8)
    idx, _ = OP(q, key, w, sparse_count=4)
    assert (idx[0, :3] == -1).all()
    assert (idx[0, 3, 0] >= 0).sum() == 1 and (idx[0, 7, 0] >= 0).sum() == 4


def mx_quantize(x, seed=0):
    """Random MXFP8 data: fp8 codes near x and one random power-of-two scale per 32 values."""
    g = torch.Generator().manual_seed(seed)
    codes = x.to(torch.float8_e4m3fn)
    exponents = torch.randint(120, 134, (*x.shape[:-1], x.shape[-1] // 32), generator=g, dtype=torch.uint8)
    return codes, exponents


def test_mxfp8_equals_dequantized_fp32():
    q, key, w = make_inputs(2, 3, 8, 64, 500, seed=9)
    q8, qs = mx_quantize(q * 4, seed=1)
    k8, ks = mx_quantize(key * 4, seed=2)
    got = OP(q8, k8, w, query_scale=qs.view(torch.float8_e8m0fnu), key_scale=ks, sparse_count=40)
    qf = q8.float() * torch.exp2(qs.float() - 127).repeat_interleave(32, -1)
    kf = k8.float() * torch.exp2(ks.float() - 127).repeat_interleave(32, -1)
    assert_same_topk(got, OP(qf, kf, w, sparse_count=40), rtol=1e-5, atol=1e-3)
    ref = li.reference_lightning_indexer(q8, k8, w, query_scale=qs, key_scale=ks, sparse_count=40)
    assert_same_topk(got, ref, rtol=1e-5, atol=1e-3)


def test_mxfp8_paged():
    q, key, w = make_inputs(2, 1, 4, 32, 200, seed=10)
    k8, ks = mx_quantize(key, seed=3)
    cache, table = to_paged(k8.view(torch.uint8), 16, seed=5)
    scale_cache, _ = to_paged(ks, 16, seed=5)
    got = OP(q, cache.view(torch.float8_e4m3fn), w, block_table=table, key_scale=scale_cache,
             layout_key="PA_BSND", actual_seq_lengths_key=torch.tensor([200, 200]), sparse_count=32)
    assert_same_topk(got, OP(q, k8, w, key_scale=ks, sparse_count=32))


def test_fp8_decoding_is_exact():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    got = indexer_keys.fp8_e4m3_to_float(codes)
    want = codes.float()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 2), s1=st.integers(1, 4), s2=st.integers(1, 40), n1=st.integers(1, 4),
       d=st.sampled_from([4, 16, 32]), k=st.integers(1, 24), mode=st.sampled_from([0, 3]),
       seed=st.integers(0, 2**16))
def test_property_definition(batch, s1, s2, n1, d, k, mode, seed):
    """Each row lists min(K, visible) distinct visible keys, its values are their scores in descending order,
    and no unlisted visible key scores higher than the last listed one."""
    q, key, w = make_inputs(batch, s1, n1, d, s2, seed=seed)
    idx, val = OP(q, key, w, sparse_count=k, sparse_mode=mode)
    score = scores_of(q, key, w)
    for b in range(batch):
        for t in range(s1):
            visible = indexer_checks.visible_keys(t, s1, s2, mode)
            chosen = idx[b, t, 0, :min(k, visible)].long()
            assert (idx[b, t, 0, min(k, visible):] == -1).all()
            assert len(set(chosen.tolist())) == chosen.numel() and (chosen < visible).all()
            torch.testing.assert_close(val[b, t, 0, :chosen.numel()], score[b, t, chosen])
            assert (val[b, t, 0, :chosen.numel()].diff() <= 0).all()
            others = torch.ones(visible, dtype=torch.bool)
            others[chosen] = False
            if chosen.numel() and others.any():
                assert score[b, t, :visible][others].max() <= val[b, t, 0, chosen.numel() - 1] + 1e-4


def bad_inputs():
    q, key, w = make_inputs(2, 3, 4, 64, 40)
    cache, table = to_paged(key, 16)
    k8, ks = mx_quantize(key)
    yield "rank 4", dict(query=q[0])
    yield "layout_query", dict(layout_query="TND")
    yield "layout_key", dict(layout_key="NZ")
    yield "sparse_count` must be > 0", dict(sparse_count=0)
    yield "sparse_mode", dict(sparse_mode=1)
    yield "dtype torch.int32", dict(query=q.int())
    yield "one head", dict(key=key.expand(2, 40, 2, 64))
    yield "head dim D", dict(key=key[..., :32])
    yield "shape of `weights`", dict(weights=w[:, :, :2])
    yield "needs `block_table`", dict(key=cache, layout_key="PA_BSND")
    yield "only used with layout_key", dict(block_table=table)
    yield "outside the 7 blocks", dict(key=cache, layout_key="PA_BSND", block_table=table + 5)
    yield "rows of `block_table`", dict(key=cache, layout_key="PA_BSND", block_table=table[:1])
    yield "needs `key_scale`", dict(key=k8)
    yield "only used with a float8", dict(key_scale=ks)
    yield "shape of `key_scale`", dict(key=k8, key_scale=ks[..., :1])
    yield "length of `actual_seq_lengths_query`", dict(actual_seq_lengths_query=torch.tensor([1, 2, 3]))
    yield r"actual_seq_lengths_key`\[1\]=41", dict(actual_seq_lengths_key=torch.tensor([40, 41]))
    yield "actual_seq_lengths_query` has dtype", dict(actual_seq_lengths_query=torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("match,change", list(bad_inputs()), ids=[m for m, _ in bad_inputs()])
def test_clear_errors(match, change):
    """Each bad call raises, every time, also after a good call with the other arguments (the static checks
    remember only the signatures that passed)."""
    q, key, w = make_inputs(2, 3, 4, 64, 40)
    OP(q, key, w)
    args = dict(query=q, key=key, weights=w) | change
    for _ in range(2):
        with pytest.raises(ValueError, match=match):
            OP(**args)


def test_inference_mode_then_normal_mode():
    """Scratch buffers first made under inference mode must not break a later call outside it."""
    q, key, w = make_inputs(1, 1, 8, 32, 3000, torch.bfloat16, seed=11)
    with torch.inference_mode():
        first = OP(q, key, w, sparse_count=256)
    second = OP(q, key, w, sparse_count=256)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_inside_torch_compile_dynamic():
    def fn(q, k, w, lk):
        idx, val = OP(q, k, w, actual_seq_lengths_key=lk, sparse_count=16)
        return idx + 1, val * 2

    compiled = torch.compile(fn, backend="eager", fullgraph=True, dynamic=True)
    for s1, s2 in [(3, 50), (5, 70)]:
        q, key, w = make_inputs(2, s1, 4, 32, s2, torch.bfloat16)
        lk = torch.tensor([s2, s2 - 7])
        got, want = compiled(q, key, w, lk), fn(q, key, w, lk)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_opcheck():
    q, key, w = make_inputs(2, 3, 4, 32, 40, torch.bfloat16)
    cache, table = to_paged(key, 16)
    torch.library.opcheck(OP.default, (q, key, w), {"sparse_count": 8})
    torch.library.opcheck(OP.default, (q, cache, w), {"block_table": table, "layout_key": "PA_BSND",
                                                      "actual_seq_lengths_key": torch.tensor([40, 33]),
                                                      "sparse_count": 8, "sparse_mode": 0})


@pytest.mark.parametrize("keys", [64, 65])
def test_equal_scores_at_the_cut_are_chosen_as_torch_topk_chooses(path, keys):
    """ReLU makes exact zero scores common (random tiny models): when zeros straddle the k-th place, the kept
    keys are the ones eager's `topk` keeps, so a model's greedy tokens do not depend on the path taken."""
    torch.manual_seed(3)
    heads, dim, k = 4, 16, 8
    q = torch.randn(1, 1, heads, dim).abs()
    key = -torch.rand(1, keys, dim)           # q·k < 0 for every head: ReLU gives exact zeros ...
    key[0, [5, 40]] = torch.rand(2, dim)      # ... but for two keys
    w = torch.rand(1, 1, heads)
    eager = (torch.einsum("bthd,bsd->bths", q, key).relu() * w[..., None]).sum(2).topk(k).indices
    got, _ = li.lightning_indexer(q, key.unsqueeze(2), w, sparse_count=k, sparse_mode=0)
    assert got.reshape(-1).tolist()[:2] == eager.reshape(-1).tolist()[:2]
    assert set(got.reshape(-1).tolist()) == set(eager.reshape(-1).tolist())

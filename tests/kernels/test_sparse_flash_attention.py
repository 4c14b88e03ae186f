"""ascend_dsa::sparse_flash_attention: fast CPU path against the fp32 reference, the dense-attention law,
paged vs BSND, skipped entries, empty rows, fp8 KV, errors, and the op inside torch.compile."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from npu_graph.kernels.sparse_attention import native as sfa_native
from npu_graph.kernels.sparse_attention import sparse_flash_attention as sfa
from npu_graph.kernels.sparse_attention import torch_path as sfa_torch

OP = torch.ops.ascend_dsa.sparse_flash_attention


def make_inputs(batch, s1, n1, dl, dr, s2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, s1, n1, dl, generator=g).to(dtype)
    kv = torch.randn(batch, s2, 1, dl, generator=g).to(dtype)
    q_rope = torch.randn(batch, s1, n1, dr, generator=g).to(dtype) if dr else None
    k_rope = torch.randn(batch, s2, 1, dr, generator=g).to(dtype) if dr else None
    return q, kv, q_rope, k_rope


def random_indices(batch, s1, s2, k, seed=0, pad=0):
    """Distinct random positions < s2 per query row, the last `pad` entries set to -1."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(s2, generator=g)[:k] for _ in range(batch * s1)]
    idx = torch.stack(rows).view(batch, s1, 1, k).to(torch.int32)
    if pad:
        idx[..., k - pad:] = -1
    return idx


def to_paged(x, block_size, seed=0):
    """The same rows in a paged cache with a shuffled block order and one spare block, and the block table."""
    batch, s2, _, d = x.shape
    per_batch = math.ceil(s2 / block_size)
    padded = torch.zeros(batch, per_batch * block_size, 1, d, dtype=x.dtype)
    padded[:, :s2] = x
    order = torch.randperm(batch * per_batch + 1, generator=torch.Generator().manual_seed(seed))
    cache = torch.zeros(batch * per_batch + 1, block_size, 1, d, dtype=x.dtype)
    cache[order[:batch * per_batch]] = padded.view(batch * per_batch, block_size, 1, d)
    return cache, order[:batch * per_batch].view(batch, per_batch).to(torch.int32)


def assert_outputs_close(got, want, atol=1e-5, rtol=1e-5):
    out, smax, ssum = got
    assert out.dtype == want[0].dtype and smax.dtype == ssum.dtype == torch.float32
    torch.testing.assert_close(out.float(), want[0].float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(smax, want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ssum, want[2], atol=1e-4, rtol=1e-5)


CASES = [  # batch, s1, n1, dl, dr, s2, k, sparse_mode, sparse_block_size, pad
    (1, 1, 16, 512, 64, 4096, 2048, 3, 1, 0),   # DSA decode
    (2, 1, 4, 64, 16, 300, 64, 3, 1, 5),
    (2, 9, 4, 64, 16, 40, 16, 3, 1, 3),         # prefill: causal masking of selected positions
    (2, 5, 2, 32, 0, 50, 12, 0, 1, 0),          # no rope, no mask
    (1, 4, 2, 32, 8, 64, 6, 3, 4, 1),           # blocks of 4 positions per index
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("large_pv_elems", [0, 1 << 62], ids=["onednn_pv", "mm_pv"])
def test_matches_reference(case, dtype, large_pv_elems, monkeypatch):
    monkeypatch.setattr(sfa_torch, "LARGE_PV_ELEMS", large_pv_elems)
    monkeypatch.setattr(sfa_torch, "onednn_bf16", lambda: True)   # the bf16 path is checked on any CPU, however slow
    batch, s1, n1, dl, dr, s2, k, mode, block, pad = case
    q, kv, qr, kr = make_inputs(batch, s1, n1, dl, dr, s2, dtype)
    idx = random_indices(batch, s1, s2 // block, k, pad=pad)
    kwargs = dict(query_rope=qr, key_rope=kr, sparse_mode=mode, sparse_block_size=block)
    scale = (dl + dr) ** -0.5
    got = OP(q, kv, kv, idx, scale, **kwargs)
    want = sfa.reference_sparse_flash_attention(q, kv, kv, idx, scale, **kwargs)
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_outputs_close(got, want, atol=atol, rtol=atol)


def dense_causal_attention(q, kv, qr, kr, scale):
    """torch SDPA over all keys with the bottom-right causal mask, query and key with rope concatenated."""
    s1, s2 = q.shape[1], kv.shape[1]
    qq = torch.cat([q, qr], -1).float().transpose(1, 2)
    kk = torch.cat([kv, kr], -1).float().transpose(1, 2)
    vv = kv.float().transpose(1, 2)
    visible = torch.arange(s2)[None, :] <= torch.arange(s1)[:, None] + (s2 - s1)
    out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=visible, scale=scale)
    return out.transpose(1, 2)


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 2), s1=st.integers(1, 6), extra=st.integers(0, 10), n1=st.integers(1, 4),
       dl=st.sampled_from([8, 32]), dr=st.sampled_from([4, 8]), slack=st.integers(0, 5),
       seed=st.integers(0, 2**16))
def test_law_equals_dense_causal_attention(batch, s1, extra, n1, dl, dr, slack, seed):
    """When the context fits in K and every row lists all keys (in any order, padded with -1), sparse
    attention with the causal mode is dense causal attention."""
    s2 = s1 + extra
    q, kv, qr, kr = make_inputs(batch, s1, n1, dl, dr, s2, seed=seed)
    idx = torch.full((batch, s1, 1, s2 + slack), -1, dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    for b in range(batch):
        for t in range(s1):
            idx[b, t, 0, torch.randperm(s2 + slack, generator=g)[:s2]] = torch.randperm(s2, generator=g).int()
    scale = (dl + dr) ** -0.5
    out, smax, ssum = OP(q, kv, kv, idx, scale, query_rope=qr, key_rope=kr)
    torch.testing.assert_close(out, dense_causal_attention(q, kv, qr, kr, scale), atol=1e-5, rtol=1e-5)
    logits = torch.einsum("bthd,bsd->bths", torch.cat([q, qr], -1), torch.cat([kv, kr], -1)[:, :, 0]) * scale
    visible = torch.arange(s2)[None, :] <= torch.arange(s1)[:, None] + (s2 - s1)
    lse = torch.logsumexp(logits.masked_fill(~visible[None, :, None, :], float("-inf")), -1)
    torch.testing.assert_close(smax + ssum.log(), lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_equals_bsnd(dtype):
    q, kv, qr, kr = make_inputs(3, 2, 4, 64, 16, 300, dtype, seed=1)
    idx = random_indices(3, 2, 300, 100, seed=2, pad=7)
    lengths = torch.tensor([300, 180, 2], dtype=torch.int32)
    cache, table = to_paged(kv, 16, seed=3)
    rope_cache, _ = to_paged(kr, 16, seed=3)
    kwargs = dict(query_rope=qr, actual_seq_lengths_kv=lengths)
    paged = OP(q, cache, cache, idx, 0.1, block_table=table, key_rope=rope_cache, layout_kv="PA_BSND", **kwargs)
    bsnd = OP(q, kv, kv, idx, 0.1, key_rope=kr, **kwargs)
    for a, b in zip(paged, bsnd):
        assert torch.equal(a, b)
    ref = sfa.reference_sparse_flash_attention(q, cache, cache, idx, 0.1, block_table=table, key_rope=rope_cache,
                                               layout_kv="PA_BSND", **kwargs)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert_outputs_close(paged, ref, atol=tol, rtol=tol)


def test_skipped_entries_anywhere():
    """-1 entries are skipped wherever they are: the result equals the call with only the valid entries."""
    q, kv, qr, kr = make_inputs(1, 1, 4, 32, 8, 100, seed=4)
    idx = random_indices(1, 1, 100, 30, seed=5)
    holes = idx.clone()
    holes[..., ::3] = -1
    compact = holes[holes >= 0].view(1, 1, 1, -1)
    got = OP(q, kv, kv, holes, 0.2, query_rope=qr, key_rope=kr)
    want = OP(q, kv, kv, compact, 0.2, query_rope=qr, key_rope=kr)
    assert_outputs_close(got, want)


def test_rows_without_keys():
    q, kv, qr, kr = make_inputs(2, 4, 4, 32, 8, 20, seed=6)
    idx = random_indices(2, 4, 20, 5, seed=7)
    idx[0, 1] = -1                                   # nothing selected
    idx[0, 2] = 19                                   # only a future position (causal: query 2 sees <= 18)
    lq = torch.tensor([4, 2])                         # rows 2 and 3 of batch 1 are not real queries
    out, smax, ssum = OP(q, kv, kv, idx, 0.3, actual_seq_lengths_query=lq, query_rope=qr, key_rope=kr)
    for b, t in [(0, 1), (0, 2), (1, 2), (1, 3)]:
        assert (out[b, t] == 0).all() and torch.isneginf(smax[b, t]).all() and (ssum[b, t] == 0).all()
    assert torch.isfinite(smax[0, 0]).all() and (ssum[0, 0] >= 1).all()


def test_inputs_are_not_modified():
    q, kv, qr, kr = make_inputs(1, 2, 4, 32, 8, 30, seed=13)
    copies = [t.clone() for t in (q, kv, qr, kr)]
    OP(q, kv, kv, random_indices(1, 2, 30, 10), 0.3, query_rope=qr, key_rope=kr)
    for t, c in zip((q, kv, qr, kr), copies):
        assert torch.equal(t, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_distinct_from_key(dtype, monkeypatch):
    monkeypatch.setattr(sfa_torch, "LARGE_PV_ELEMS", 0)
    monkeypatch.setattr(sfa_torch, "onednn_bf16", lambda: True)
    q, kv, qr, kr = make_inputs(2, 3, 4, 32, 8, 60, dtype=dtype, seed=8)
    value = torch.randn_like(kv)
    idx = random_indices(2, 3, 60, 20, seed=9, pad=2)
    got = OP(q, kv, value, idx, 0.2, query_rope=qr, key_rope=kr)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_outputs_close(got, sfa.reference_sparse_flash_attention(q, kv, value, idx, 0.2, query_rope=qr,
                                                                   key_rope=kr), atol=tol, rtol=tol)


def test_fp8_kv_equals_dequantized():
    q, kv, qr, kr = make_inputs(2, 2, 4, 256, 16, 80, torch.bfloat16, seed=10)
    codes = (kv.float() * 8).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 80, 1, 2, generator=torch.Generator().manual_seed(12)) + 0.05
    idx = random_indices(2, 2, 80, 30, seed=11)
    got = OP(q, codes, codes, idx, 0.05, query_rope=qr, key_rope=kr, key_scale=scale, value_scale=scale)
    dequant = (codes.float().unflatten(-1, (2, 128)) * scale[..., None]).flatten(-2)
    want = OP(q, dequant, dequant, idx, 0.05, query_rope=qr, key_rope=kr)
    assert_outputs_close(got, want, atol=1e-2, rtol=1e-2)
    ref = sfa.reference_sparse_flash_attention(q, codes, codes, idx, 0.05, query_rope=qr, key_rope=kr,
                                               key_scale=scale, value_scale=scale)
    assert_outputs_close(got, ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("tokens", [1, 12])
def test_fp8_rope_key_equals_dequantized(paged, tokens):
    """An FP8 RoPE key with one fp32 scale per token (key_rope_scale [..., 1]), beside an FP8 latent: the same
    outputs as the dequantized rope key, on the per-row path (one token) and the prefill's (twelve)."""
    q, kv, qr, kr = make_inputs(2, tokens, 4, 256, 64, 80, torch.bfloat16, seed=16)
    codes, scale = torch.ops.ascend_dsa.dynamic_block_quant(kv.float(), block_size=128)
    rope_codes, rope_scale = torch.ops.ascend_dsa.dynamic_block_quant(kr.float(), block_size=64)
    rope = torch.ops.ascend_dsa.dequant_block(rope_codes, rope_scale, block_size=64)
    idx = random_indices(2, tokens, 80, 30, seed=17, pad=2)
    args = dict(query_rope=qr, key_scale=scale, value_scale=scale)
    if paged:
        (codes, table), scale = to_paged(codes, 16), to_paged(scale, 16)[0]
        rope_codes, rope_scale, rope = (to_paged(x, 16)[0] for x in (rope_codes, rope_scale, rope))
        args.update(block_table=table, key_scale=scale, value_scale=scale, layout_kv="PA_BSND",
                    actual_seq_lengths_kv=torch.tensor([80, 80]))
    got = OP(q, codes, codes, idx, 0.05, key_rope=rope_codes, key_rope_scale=rope_scale, **args)
    assert_outputs_close(got, OP(q, codes, codes, idx, 0.05, key_rope=rope, **args), atol=1e-2, rtol=1e-2)
    ref = sfa.reference_sparse_flash_attention(q, codes, codes, idx, 0.05, key_rope=rope_codes,
                                               key_rope_scale=rope_scale, **args)
    assert_outputs_close(got, ref, atol=1e-2, rtol=1e-2)


def test_fp8_rope_key_adds_little_to_the_fp8_latents_error():
    """DeepSeek-V3.2's latent and rope dims (512 + 64, softmax scale 1/sqrt(192)), 32 heads, 1024 of 4096 rows: the
    output over an FP8 latent and FP8 RoPE key stays within the FP8 KV bound the quantize tests use (cosine > 0.999
    against bf16 KV), and the FP8 RoPE key adds under a tenth to the FP8 latent's own relative error."""
    g = torch.Generator().manual_seed(0)
    q, qr = torch.randn(1, 1, 32, 512, generator=g).bfloat16(), torch.randn(1, 1, 32, 64, generator=g).bfloat16()
    kv, kr = torch.randn(1, 4096, 1, 512, generator=g).bfloat16(), torch.randn(1, 4096, 1, 64, generator=g).bfloat16()
    idx = torch.randperm(4096, generator=g)[:1024].int().view(1, 1, 1, 1024)
    scale = 192 ** -0.5
    codes, tiles = torch.ops.ascend_dsa.dynamic_block_quant(kv.float(), block_size=128)
    rope_codes, rope_scale = torch.ops.ascend_dsa.dynamic_block_quant(kr.float(), block_size=64)
    bf16 = OP(q, kv, kv, idx, scale, query_rope=qr, key_rope=kr)[0].float()
    fp8 = dict(key_scale=tiles, value_scale=tiles)
    latent = OP(q, codes, codes, idx, scale, query_rope=qr, key_rope=kr, **fp8)[0].float()
    both = OP(q, codes, codes, idx, scale, query_rope=qr, key_rope=rope_codes, key_rope_scale=rope_scale,
              **fp8)[0].float()
    cosine = torch.nn.functional.cosine_similarity(both.flatten(), bf16.flatten(), dim=0)
    assert cosine > 0.999
    assert (both - bf16).norm() < 1.1 * (latent - bf16).norm()


@pytest.mark.parametrize("paged", [False, True])
def test_fp8_kv_prefill_dequantized_once(paged, monkeypatch):
    """Query tokens that read the cache over in all (a prefill) dequantize it once and run the native kernel;
    the result matches the reference on the scaled fp8 rows and the per-row torch path."""
    q, kv, qr, kr = make_inputs(2, 12, 4, 256, 16, 80, torch.bfloat16, seed=13)
    codes = (kv.float() * 8).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 80, 1, 2, generator=torch.Generator().manual_seed(14)) + 0.05
    idx = random_indices(2, 12, 80, 30, seed=15, pad=3)
    args = dict(query_rope=qr, key_scale=scale, value_scale=scale, sparse_mode=0)
    if paged:
        (codes, table), scale = to_paged(codes, 16), to_paged(scale, 16)[0]
        args.update(block_table=table, key_scale=scale, value_scale=scale, layout_kv="PA_BSND",
                    actual_seq_lengths_kv=torch.tensor([80, 80]))
        kr = to_paged(kr, 16)[0]
    taken = []
    wrapped = sfa_native.native_dequantized
    monkeypatch.setattr(sfa_native, "native_dequantized", lambda *a: taken.append(wrapped(*a)) or taken[-1])
    got = OP(q, codes, codes, idx, 0.05, key_rope=kr, **args)
    if sfa_native.native.load(sfa.NATIVE_SOURCE):
        assert taken == [True, True]
    monkeypatch.setattr(sfa_native, "native_dequantized", lambda *a: False)
    per_row = OP(q, codes, codes, idx, 0.05, key_rope=kr, **args)
    assert_outputs_close(got, per_row, atol=1e-2, rtol=1e-2)
    ref = sfa.reference_sparse_flash_attention(q, codes, codes, idx, 0.05, key_rope=kr, **args)
    assert_outputs_close(got, ref, atol=1e-2, rtol=1e-2)


def bad_inputs():
    q, kv, _, kr = make_inputs(2, 3, 4, 128, 8, 40)
    idx = random_indices(2, 3, 40, 8)
    cache, table = to_paged(kv, 16)
    paged = dict(key=cache, value=cache, key_rope=to_paged(kr, 16)[0], layout_kv="PA_BSND")
    codes = kv.to(torch.float8_e4m3fn)
    yield "rank 4", dict(query=q[0])
    yield "layout_kv", dict(layout_kv="TND")
    yield "layout_query", dict(layout_query="TND")
    yield "sparse_mode", dict(sparse_mode=2)
    yield "sparse_block_size` must be > 0", dict(sparse_block_size=0)
    yield "one head", dict(key=kv.expand(2, 40, 2, 128), value=kv.expand(2, 40, 2, 128))
    yield "head dim Dl", dict(key=kv[..., :64], value=kv[..., :64])
    yield "shapes of `value` and `key`", dict(value=kv[:, :20])
    yield "dtypes of `value` and `key`", dict(value=kv.bfloat16())
    yield "leading dims of `sparse_indices`", dict(sparse_indices=idx[:, :2])
    yield "selects no keys", dict(sparse_indices=idx[..., :0])
    yield "sparse_indices` has dtype", dict(sparse_indices=idx.float())
    yield "entries must be >= 0, or -1", dict(sparse_indices=idx - 5)
    yield "go together", dict(key_rope=None)
    yield "rope dim Dr", dict(key_rope=kr[..., :4])
    yield "needs `block_table`", paged
    yield "only used with layout_kv", dict(block_table=table)
    yield "outside the 7 blocks", paged | dict(block_table=table - 3)
    yield "needs `key_scale`", dict(key=codes, value=codes)
    yield "shape of `key_scale`", dict(key=codes, value=codes, key_scale=torch.ones(2, 40, 1, 2),
                                       value_scale=torch.ones(2, 40, 1, 1))
    yield "only used with a float8", dict(key_scale=torch.ones(2, 40, 1, 1))
    yield "needs `key_rope_scale`", dict(key_rope=kr.to(torch.float8_e4m3fn))
    yield "shape of `key_rope_scale`", dict(key_rope=kr.to(torch.float8_e4m3fn),
                                            key_rope_scale=torch.ones(2, 40, 1, 2))
    yield r"actual_seq_lengths_kv`\[0\]=41", dict(actual_seq_lengths_kv=torch.tensor([41, 3]))


@pytest.mark.parametrize("match,change", list(bad_inputs()), ids=[m for m, _ in bad_inputs()])
def test_clear_errors(match, change):
    q, kv, qr, kr = make_inputs(2, 3, 4, 128, 8, 40)
    args = dict(query=q, key=kv, value=kv, sparse_indices=random_indices(2, 3, 40, 8), scale_value=0.1,
                query_rope=qr, key_rope=kr) | change
    with pytest.raises(ValueError, match=match):
        OP(**args)


def test_inference_mode_then_normal_mode():
    q, kv, qr, kr = make_inputs(1, 1, 4, 64, 16, 500, torch.bfloat16, seed=14)
    idx = random_indices(1, 1, 500, 100, seed=15)
    with torch.inference_mode():
        first = OP(q, kv, kv, idx, 0.1, query_rope=qr, key_rope=kr)
    second = OP(q, kv, kv, idx, 0.1, query_rope=qr, key_rope=kr)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_inside_torch_compile_dynamic():
    def fn(q, kv, idx, qr, kr, lk):
        out, smax, ssum = OP(q, kv, kv, idx, 0.125, actual_seq_lengths_kv=lk, query_rope=qr, key_rope=kr)
        return out * 2, smax + ssum.log()

    compiled = torch.compile(fn, backend="eager", fullgraph=True, dynamic=True)
    for s1, s2, k in [(3, 50, 16), (5, 70, 24)]:
        q, kv, qr, kr = make_inputs(2, s1, 4, 64, 16, s2, torch.bfloat16)
        args = (q, kv, random_indices(2, s1, s2, k), qr, kr, torch.tensor([s2, s2 - 9]))
        for got, want in zip(compiled(*args), fn(*args)):
            assert torch.equal(got, want)


def test_opcheck():
    q, kv, qr, kr = make_inputs(2, 3, 4, 64, 16, 40, torch.bfloat16)
    idx = random_indices(2, 3, 40, 8, pad=2)
    cache, table = to_paged(kv, 16)
    rope_cache, _ = to_paged(kr, 16)
    torch.library.opcheck(OP.default, (q, kv, kv, idx, 0.1), {"query_rope": qr, "key_rope": kr})
    torch.library.opcheck(OP.default, (q, cache, cache, idx, 0.1),
                          {"block_table": table, "query_rope": qr, "key_rope": rope_cache, "layout_kv": "PA_BSND",
                           "actual_seq_lengths_kv": torch.tensor([40, 35], dtype=torch.int32)})


def test_fake_output_layout_matches_the_cpu_path_for_a_permuted_query():
    """A query laid out [B, N, S, D] and viewed as BSND (what attention code hands over): the output is
    contiguous on every path, and the fake says so (Inductor checks the strides of what it calls)."""
    q, kv, qr, kr = make_inputs(2, 3, 4, 64, 16, 40, torch.float32)
    q, qr = q.transpose(1, 2).contiguous().transpose(1, 2), qr.transpose(1, 2).contiguous().transpose(1, 2)
    torch.library.opcheck(OP.default, (q, kv, kv, random_indices(2, 3, 40, 8, pad=2), 0.1),
                          {"query_rope": qr, "key_rope": kr})

"""ascend_dsa::sparse_flash_attention through the native kernel (kernels/native/sparse_attention.c) and through
the torch path (ASCEND_DSA_NATIVE=0), both against the fp32 reference: BSND and paged KV, fp32/bf16/fp16, -1
entries, empty selections, blocks of positions, duplicates, distinct values, split and unsplit tokens."""
import pytest
import torch
from native_paths import native_and_torch
from test_sparse_flash_attention import assert_outputs_close, make_inputs, random_indices, to_paged

from npu_graph.kernels.native import loader as native
from npu_graph.kernels.sparse_attention import native as sfa_native
from npu_graph.kernels.sparse_attention import sparse_flash_attention as sfa

OP = torch.ops.ascend_dsa.sparse_flash_attention
LOADED, WHY = native.available(sfa.NATIVE_SOURCE)

path = native_and_torch(sfa.NATIVE_SOURCE)


def check_path(path, q, kv, kr, table=None):
    """The path the op takes for these inputs is the one the test asked for."""
    used = sfa_native.native_kernel(kv, kv, kr, table) is not None
    assert used == (path == "native")


def tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


CASES = [  # batch, s1, n1, dl, dr, s2, k, sparse_mode, sparse_block_size, pad
    (1, 1, 16, 512, 64, 1024, 512, 3, 1, 0),    # decode: one token split across the threads
    (1, 1, 20, 64, 16, 300, 100, 3, 1, 7),      # heads beyond one vector of 16
    (2, 7, 4, 48, 8, 40, 16, 3, 1, 3),          # prefill: a thread per token, causal masking
    (2, 3, 3, 24, 0, 50, 12, 0, 1, 0),          # no rope, dims not multiples of 16
    (1, 4, 2, 32, 6, 64, 6, 3, 4, 1),           # blocks of 4 positions per index
    (1, 3, 20, 64, 32, 200, 21, 3, 1, 2),       # tile-shaped dims (amx_bf16), chunks of 21 and fewer rows
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("split_rows", [1, 1 << 40], ids=["split", "whole"])
def test_matches_reference(case, dtype, split_rows, path, monkeypatch):
    monkeypatch.setattr(sfa_native, "NATIVE_SPLIT_ROWS", split_rows)
    batch, s1, n1, dl, dr, s2, k, mode, block, pad = case
    q, kv, qr, kr = make_inputs(batch, s1, n1, dl, dr, s2, dtype, seed=s2)
    idx = random_indices(batch, s1, s2 // block, k, seed=k, pad=pad)
    check_path(path, q, kv, kr)
    kwargs = dict(query_rope=qr, key_rope=kr, sparse_mode=mode, sparse_block_size=block)
    scale = (dl + dr) ** -0.5
    got = OP(q, kv, kv, idx, scale, **kwargs)
    want = sfa.reference_sparse_flash_attention(q, kv, kv, idx, scale, **kwargs)
    assert_outputs_close(got, want, atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dr", [16, 32])       # 32: tile-shaped dims (amx_bf16)
def test_paged_distinct_values_duplicates_and_empty_rows(dtype, dr, path):
    """Paged cache with shuffled blocks, values distinct from keys, positions listed twice, a row with only
    -1 entries, a row that selects only invisible positions and a batch with no query tokens."""
    q, kv, qr, kr = make_inputs(3, 4, 4, 64, dr, 90, dtype, seed=21)
    value = torch.randn(kv.shape, generator=torch.Generator().manual_seed(22)).to(dtype)
    idx = random_indices(3, 4, 90, 40, seed=23, pad=6)
    idx[0, 0, 0, 1::2] = idx[0, 0, 0, 0::2]          # every position twice
    idx[1, 1] = -1
    idx[1, 0] = 89                                    # causal: token 0 of 4 sees positions <= 86
    cache, table = to_paged(kv, 16, seed=24)
    value_cache, _ = to_paged(value, 16, seed=24)
    rope_cache, _ = to_paged(kr, 16, seed=24)
    check_path(path, q, cache, rope_cache, table)
    kwargs = dict(block_table=table, query_rope=qr, key_rope=rope_cache, layout_kv="PA_BSND",
                  actual_seq_lengths_query=torch.tensor([4, 4, 0]), actual_seq_lengths_kv=torch.tensor([90, 87, 5]))
    got = OP(q, cache, value_cache, idx, 0.1, **kwargs)
    want = sfa.reference_sparse_flash_attention(q, cache, value_cache, idx, 0.1, **kwargs)
    assert_outputs_close(got, want, atol=tolerance(dtype), rtol=tolerance(dtype))
    out, smax, ssum = got
    for b, t in [(1, 0), (1, 1), (2, 0), (2, 3)]:
        assert (out[b, t] == 0).all() and torch.isneginf(smax[b, t]).all() and (ssum[b, t] == 0).all()


@pytest.mark.parametrize("threads", [3, 5])
def test_split_tokens_merged_by_the_team(threads, path, torch_threads, monkeypatch):
    """Two tokens' entries split across 3 or 5 threads, their parts merged by the whole team (40 token-head pairs
    shared unevenly; the last one belongs to a token with entries), the first token with only -1 entries: the
    reference's outputs."""
    monkeypatch.setattr(sfa_native, "NATIVE_SPLIT_ROWS", 1)
    torch_threads(threads)
    q, kv, qr, kr = make_inputs(1, 2, 20, 64, 16, 300, torch.float32, seed=51)
    idx = random_indices(1, 2, 300, 120, seed=52, pad=5)
    idx[0, 0] = -1
    check_path(path, q, kv, kr)
    kwargs = dict(query_rope=qr, key_rope=kr, sparse_mode=0)
    got = OP(q, kv, kv, idx, 0.125, **kwargs)
    want = sfa.reference_sparse_flash_attention(q, kv, kv, idx, 0.125, **kwargs)
    assert_outputs_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got[0][0, 0] == 0).all() and torch.isneginf(got[1][0, 0]).all()


def test_strided_kv_takes_the_torch_path():
    """KV rows that are not contiguous along D are read by the torch path, with the same result."""
    q, kv, qr, kr = make_inputs(1, 2, 4, 32, 8, 60, seed=31)
    wide = torch.stack([kv, torch.zeros_like(kv)], -1).flatten(-2)[..., ::2]
    assert torch.equal(wide, kv) and wide.stride(3) == 2
    assert sfa_native.native_kernel(wide, wide, kr, None) is None
    idx = random_indices(1, 2, 60, 20, seed=32)
    got = OP(q, wide, wide, idx, 0.2, query_rope=qr, key_rope=kr)
    assert_outputs_close(got, sfa.reference_sparse_flash_attention(q, kv, kv, idx, 0.2, query_rope=qr,
                                                                   key_rope=kr))


def test_bf16_matches_torch_path(monkeypatch):
    """The DSA decode shape in bf16: the native kernel (bf16 dot products where the CPU has them) and the
    torch path agree to bf16 output precision."""
    if not LOADED:
        pytest.skip(f"native kernel not available: {WHY}")
    q, kv, qr, kr = make_inputs(1, 1, 16, 512, 64, 4096, torch.bfloat16, seed=41)
    idx = random_indices(1, 1, 4096, 2048, seed=42)
    args = (q, kv, kv, idx, 576 ** -0.5)
    got = OP(*args, query_rope=qr, key_rope=kr)
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    want = OP(*args, query_rope=qr, key_rope=kr)
    assert_outputs_close(got, want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("n1", [8, 12])
def test_fp32_rows_read_in_place_at_any_alignment(n1, path):
    """fp32 KV rows are read where they are stored (no copy): rows starting one value past a 64-byte boundary,
    a paged cache, 8 heads (the 8-head micro-kernels) and 12 (16-head vectors, 4 padded)."""
    q, kv, qr, kr = make_inputs(1, 2, n1, 64, 16, 160, seed=51)
    paged, table = to_paged(kv, 16, seed=52)
    cache = torch.zeros(paged.numel() + 1)[1:].view(paged.shape)
    cache.copy_(paged)
    assert cache.data_ptr() % 64 != 0 and cache.stride(3) == 1
    rope_cache, _ = to_paged(kr, 16, seed=52)
    check_path(path, q, cache, rope_cache, table)
    idx = random_indices(1, 2, 160, 48, seed=53, pad=5)
    kwargs = dict(block_table=table, query_rope=qr, key_rope=rope_cache, layout_kv="PA_BSND")
    got = OP(q, cache, cache, idx, 0.125, **kwargs)
    assert_outputs_close(got, sfa.reference_sparse_flash_attention(q, cache, cache, idx, 0.125, **kwargs))

"""ascend_dsa::lightning_indexer with int8 operands (per-token int8: one fp32 scale per row of D values, the form of
Ascend's quantized lightning indexer on Atlas A2/A3) through the native kernel, which decodes the keys where it
scores them (kernels/native/lightning_indexer.c), at every instruction-set level this CPU can execute and through
the torch path (ASCEND_DSA_NATIVE=0), against the readable fp32 reference: BSND and paged keys and scales, int8,
bf16 and fp32 queries, every int8 code under a wide range of scales, NaN scales, decode and prefill rows; and the
refusals (an int8 key without its scales, scales of the wrong shape)."""
import pytest
import torch
from native_paths import native_and_torch
from test_lightning_indexer import assert_same_topk, make_inputs, to_paged

from npu_graph.kernels.indexer import lightning_indexer as li
from npu_graph.kernels.indexer import native as li_native
from npu_graph.kernels.indexer.keys import dequantize
from npu_graph.kernels.native import loader as native

OP = torch.ops.ascend_dsa.lightning_indexer
QUANT = torch.ops.ascend_dsa.dynamic_block_quant
LOADED, WHY = native.available(li_native.NATIVE_SOURCE)
path = native_and_torch(li_native.NATIVE_SOURCE)


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized per row of its last dim: (int8 codes, fp32 scales [..., 1])."""
    return QUANT(x.float(), block_size=x.shape[-1], dst_type=torch.int8)


CASES = [  # batch, s1, n1, d, s2, k, sparse_mode
    (1, 1, 64, 128, 5000, 512, 3),    # DeepSeek-V3.2 indexer heads and dim, one decode row
    (2, 1, 16, 64, 700, 64, 3),
    (1, 3, 20, 48, 300, 50, 3),       # a few decode rows (MTP), heads beyond one vector, D not a multiple of 32
    (2, 5, 8, 32, 90, 20, 0),         # prefill rows, no mask
    (1, 2, 16, 32, 10, 32, 3),        # fewer visible keys than sparse_count: -1 padding
]


@pytest.mark.parametrize("query_form", ["int8", "bf16", "fp32"])
@pytest.mark.parametrize("case", CASES)
def test_int8_keys_match_reference(case, query_form, path):
    batch, s1, n1, d, s2, k, mode = case
    q, key, w = make_inputs(batch, s1, n1, d, s2, seed=s2 + d)
    codes, scale = int8_rows(key)
    q_scale = None
    if query_form == "int8":
        q, q_scale = int8_rows(q)
    elif query_form == "bf16":
        q = q.bfloat16()
    assert li_native.takes(q, codes, scale) or path == "torch"
    got = OP(q, codes, w, query_scale=q_scale, key_scale=scale, sparse_count=k, sparse_mode=mode)
    want = li.reference_lightning_indexer(q, codes, w, query_scale=q_scale, key_scale=scale, sparse_count=k,
                                          sparse_mode=mode)
    assert_same_topk(got, want, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("block_size", [16, 128])
def test_paged_int8_keys_with_lengths(block_size, path):
    q, key, w = make_inputs(2, 1, 64, 128, 1000, seed=7)
    codes, scale = int8_rows(key)
    cache, table = to_paged(codes, block_size, seed=block_size)
    scales, _ = to_paged(scale, block_size, seed=block_size)
    q, q_scale = int8_rows(q)
    assert (li_native.row_scorer(q, cache, table, scales) is not None) == (path != "torch")
    lengths_q, lengths_k = torch.tensor([1, 1]), torch.tensor([1000, 613], dtype=torch.int32)
    got = OP(q, cache, w, lengths_q, lengths_k, table, q_scale, scales, layout_key="PA_BSND", sparse_count=128)
    want = li.reference_lightning_indexer(q, codes, w, lengths_q, lengths_k, query_scale=q_scale, key_scale=scale,
                                          sparse_count=128)
    assert_same_topk(got, want, rtol=1e-5, atol=1e-3)


@pytest.mark.skipif(not LOADED, reason=f"native kernel not available: {WHY}")
def test_every_code_under_every_scale_is_decoded_exactly(isa_level):
    """Keys holding all 255 symmetric int8 codes (and -128, which the quantizer never writes but a cache may hold)
    under scales from 2^-100 to 2^100: the kernel's scores equal sums over code * scale computed in fp64."""
    g = torch.Generator().manual_seed(0)
    codes = (torch.randperm(256 * 8, generator=g) % 256 - 128).to(torch.int8).view(64, 1, 1, 32)
    scale = torch.ldexp(torch.ones(64, 1, 1, 1), torch.randint(-100, 100, (64, 1, 1, 1), generator=g))
    keys = dequantize(codes, scale)
    q = torch.randn(1, 1, 16, 32, generator=g)
    w = torch.rand(1, 1, 16, generator=g)
    score = li_native.row_scorer(q, codes.view(1, 64, 1, 32), None, scale.view(1, 64, 1, 1))(0, 64, q[0, 0], w[0, 0])
    dots = torch.einsum("hd,sd->hs", q[0, 0].double(), keys.view(64, 32).double())
    want = (dots.relu() * w[0, 0, :, None].double()).sum(0).float()
    torch.testing.assert_close(score, want, rtol=1e-5, atol=0)


def test_nan_scale_makes_its_keys_nan_and_ranks_them_first(path):
    q, key, w = make_inputs(1, 1, 8, 64, 300, seed=4)
    codes, scale = int8_rows(key)
    scale[0, 17, 0, 0] = float("nan")
    idx, val = OP(q.bfloat16(), codes, w, key_scale=scale, sparse_count=8)
    assert idx[0, 0, 0, 0] == 17 and val[0, 0, 0, 0].isnan() and not val[0, 0, 0, 1:].isnan().any()


def test_a_non_finite_query_row_quantizes_to_a_nan_scale_and_nan_scores():
    q, key, w = make_inputs(1, 1, 8, 64, 300, seed=5)
    q[0, 0, 3, 9] = float("inf")
    q_codes, q_scale = int8_rows(q)
    codes, scale = int8_rows(key)
    assert q_scale[0, 0, 3, 0].isnan() and not q_scale[0, 0, :3].isnan().any()
    _, val = OP(q_codes, codes, w, query_scale=q_scale, key_scale=scale, sparse_count=8)
    assert val.isnan().all()


def test_int8_operands_need_their_row_scales():
    q, key, w = make_inputs(1, 1, 8, 64, 30)
    codes, scale = int8_rows(key)
    with pytest.raises(ValueError, match=r"int8 `key` needs `key_scale` \(int8, one fp32 scale per row"):
        OP(q, codes, w, sparse_count=4)
    with pytest.raises(ValueError, match=r"shape of `key_scale` and the expected \[\.\.\., 1\]"):
        OP(q, codes, w, key_scale=scale.expand(1, 30, 1, 2).contiguous(), sparse_count=4)
    with pytest.raises(ValueError, match=r"`key_scale` has dtype torch\.bfloat16; expected one of torch\.float32"):
        OP(q, codes, w, key_scale=scale.bfloat16(), sparse_count=4)
    with pytest.raises(ValueError, match=r"`query_scale` is only used with a float8_e4m3fn or int8 `query`"):
        OP(q, codes, w, query_scale=torch.ones(1, 1, 8, 1), key_scale=scale, sparse_count=4)
    if LOADED:
        assert li_native.row_scorer(q, codes, None) is None

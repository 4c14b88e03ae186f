"""ascend_dsa::lightning_indexer with MXFP8 keys (float8_e4m3fn codes, one E8M0 scale per 32 values) through the
native kernel, which decodes the keys where it scores them (kernels/native/lightning_indexer.c), at every
instruction-set level this CPU can execute (bf16 dot products at avx512_bf16, the fp32 micro-kernel below it) and
through the torch path (ASCEND_DSA_NATIVE=0), against the readable fp32 reference: BSND and paged keys and scales,
MXFP8, bf16 and fp32 queries, every e4m3 code and a wide range of scales, NaN codes and scales, decode rows
and prefill rows; and the refusal of an MXFP8 key without its scales."""
import pytest
import torch
from native_paths import native_and_torch
from test_lightning_indexer import assert_same_topk, make_inputs, to_paged

from npu_graph.kernels.indexer import lightning_indexer as li
from npu_graph.kernels.indexer import native as li_native
from npu_graph.kernels.indexer.keys import dequantize
from npu_graph.kernels.native import loader as native

OP = torch.ops.ascend_dsa.lightning_indexer
FP8 = torch.float8_e4m3fn
LOADED, WHY = native.available(li_native.NATIVE_SOURCE)
path = native_and_torch(li_native.NATIVE_SOURCE)


def mx_keys(key, seed, low=118, high=136):
    """key as MXFP8: codes of the op's own quantizer, then scales moved by a random power of two per group (the
    codes' values change with them, which the test does not mind: the reference reads the same codes and scales)."""
    codes, exponents = torch.ops.ascend_dsa.dynamic_mx_quant(key.float(), block_size=32)
    g = torch.Generator().manual_seed(seed)
    shift = torch.randint(low - 127, high - 127, exponents.shape, generator=g)
    scale = (exponents.view(torch.uint8).int() + shift).clamp(1, 254).to(torch.uint8)
    return codes, scale


def check_native(path, q, key, table, scale):
    assert li_native.takes(q, key, scale) == (path != "torch") or path == "torch"
    assert (li_native.row_scorer(q, key, table, scale) is not None) == (path != "torch")


CASES = [  # batch, s1, n1, d, s2, k, sparse_mode
    (1, 1, 64, 128, 5000, 512, 3),    # DeepSeek-V3.2 indexer heads and dim, one decode row
    (2, 1, 16, 64, 700, 64, 3),
    (1, 3, 20, 32, 300, 50, 3),       # a few decode rows (MTP), heads beyond one vector
    (2, 5, 8, 32, 90, 20, 0),         # prefill rows, no mask
    (1, 2, 16, 32, 10, 32, 3),        # fewer visible keys than sparse_count: -1 padding
]


@pytest.mark.parametrize("query_form", ["mxfp8", "bf16", "fp32"])
@pytest.mark.parametrize("case", CASES)
def test_mxfp8_keys_match_reference(case, query_form, path):
    batch, s1, n1, d, s2, k, mode = case
    q, key, w = make_inputs(batch, s1, n1, d, s2, seed=s2 + d)
    codes, scale = mx_keys(key, seed=s2)
    q_scale = None
    if query_form == "mxfp8":
        q, q_scale = torch.ops.ascend_dsa.dynamic_mx_quant(q, block_size=32)
    elif query_form == "bf16":
        q = q.bfloat16()
    check_native(path, q, codes, None, scale)
    got = OP(q, codes, w, query_scale=q_scale, key_scale=scale, sparse_count=k, sparse_mode=mode)
    want = li.reference_lightning_indexer(q, codes, w, query_scale=q_scale, key_scale=scale, sparse_count=k,
                                          sparse_mode=mode)
    assert_same_topk(got, want, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("block_size", [16, 128])
def test_paged_mxfp8_keys_with_lengths(block_size, path):
    q, key, w = make_inputs(2, 1, 64, 128, 1000, seed=7)
    codes, scale = mx_keys(key, seed=3)
    cache, table = to_paged(codes.view(torch.uint8), block_size, seed=block_size)
    scales, _ = to_paged(scale, block_size, seed=block_size)
    cache = cache.view(FP8)
    q = q.bfloat16()
    check_native(path, q, cache, table, scales)
    lengths_q, lengths_k = torch.tensor([1, 1]), torch.tensor([1000, 613], dtype=torch.int32)
    got = OP(q, cache, w, lengths_q, lengths_k, table, key_scale=scales.view(torch.float8_e8m0fnu),
             layout_key="PA_BSND", sparse_count=128)
    want = li.reference_lightning_indexer(q, codes, w, lengths_q, lengths_k, key_scale=scale, sparse_count=128)
    assert_same_topk(got, want, rtol=1e-5, atol=1e-3)


@pytest.mark.skipif(not LOADED, reason=f"native kernel not available: {WHY}")
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
def test_every_code_and_scale_is_decoded_exactly(query_dtype, isa_level):
    """Keys holding all 256 e4m3 codes (subnormals, both zeros, the NaN codes) under scales from 2^-100 to 2^100:
    the kernel's scores equal fp32 sums over the exactly decoded keys; NaN codes make their key's score NaN."""
    g = torch.Generator().manual_seed(0)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)[torch.randperm(256 * 8, generator=g) % 256]
    codes = codes.view(FP8).view(64, 1, 1, 32)
    scale = torch.randint(27, 228, (64, 1, 1, 1), generator=g, dtype=torch.uint8)
    keys = dequantize(codes, scale)
    q = torch.randn(1, 1, 16, 32, generator=g).to(query_dtype)
    w = torch.rand(1, 1, 16, generator=g)
    key, key_scale = codes.view(1, 64, 1, 32), scale.view(1, 64, 1, 1)
    score = li_native.row_scorer(q, key, None, key_scale)(0, 64, q[0, 0], w[0, 0])
    dots = torch.einsum("hd,sd->hs", q[0, 0].double(), keys.view(64, 32).double())
    want = (dots.relu() * w[0, 0, :, None].double()).sum(0).float()
    nan = keys.view(64, 32).isnan().any(-1)
    assert torch.equal(score.isnan(), nan) and nan.any()
    torch.testing.assert_close(score[~nan], want[~nan], rtol=1e-5, atol=0)


@pytest.mark.skipif(not LOADED, reason=f"native kernel not available: {WHY}")
def test_nan_scale_makes_its_keys_nan_and_ranks_them_first(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    q, key, w = make_inputs(1, 1, 8, 64, 300, seed=4)
    codes, scale = mx_keys(key, seed=1)
    scale[0, 17, 0, 1] = 255
    idx, val = OP(q.bfloat16(), codes, w, key_scale=scale, sparse_count=8)
    assert idx[0, 0, 0, 0] == 17 and val[0, 0, 0, 0].isnan() and not val[0, 0, 0, 1:].isnan().any()


@pytest.mark.skipif(not LOADED, reason=f"native kernel not available: {WHY}")
def test_mxfp8_key_without_scales_is_refused_by_the_kernel():
    q, key, _ = make_inputs(1, 1, 8, 64, 30)
    codes, _ = mx_keys(key, seed=0)
    assert li_native.row_scorer(q, codes, None) is None
    assert li_native.native_path(q, codes, None, torch.ones(1, 1, 8), 4, 3, (None, None), lambda *a: None) is None

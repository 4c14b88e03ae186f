"""Decode steps of ascend_dsa::sparse_flash_attention over scaled fp8 KV: each token's selected rows are decoded
natively into a small fp32 buffer and read by the native kernel; the result is the reference's on the fp8 rows
and the per-row torch path's, for BSND and paged caches, block selections, skipped entries and both modes."""
import pytest
import torch

from npu_graph.kernels.sparse_attention import native as sfa_native
from npu_graph.kernels.sparse_attention import sparse_flash_attention as sfa
from tests.kernels.test_sparse_flash_attention import OP, assert_outputs_close, make_inputs, random_indices, to_paged


def fp8_case(tokens, dr, paged, dtype):
    q, kv, qr, kr = make_inputs(2, tokens, 4, 256, dr, 96, dtype, seed=21)
    codes, scale = torch.ops.ascend_dsa.dynamic_block_quant(kv.float(), block_size=128)
    rope_codes, rope_scale = torch.ops.ascend_dsa.dynamic_block_quant(kr.float(), block_size=dr)
    args = dict(query_rope=qr, key_scale=scale, value_scale=scale, key_rope=rope_codes, key_rope_scale=rope_scale)
    if paged:
        (codes, table), scale = to_paged(codes, 16, seed=3), to_paged(scale, 16, seed=3)[0]
        rope_codes, rope_scale = (to_paged(x, 16, seed=3)[0] for x in (rope_codes, rope_scale))
        args.update(block_table=table, key_scale=scale, value_scale=scale, key_rope=rope_codes,
                    key_rope_scale=rope_scale, layout_kv="PA_BSND", actual_seq_lengths_kv=torch.tensor([96, 70]))
    return q, codes, args


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("block,mode", [(1, 3), (4, 0), (2, 3)])
@pytest.mark.parametrize("dtype,dr", [(torch.bfloat16, 64), (torch.float32, 20)])
def test_fp8_decode_takes_the_native_kernel_and_matches_the_reference(paged, block, mode, dtype, dr, monkeypatch):
    q, codes, args = fp8_case(2, dr, paged, dtype)
    idx = random_indices(2, 2, 96 // block, 10, seed=22, pad=2)
    taken = []
    wrapped = sfa_native.native_gathered
    monkeypatch.setattr(sfa_native, "native_gathered", lambda *a: taken.append(wrapped(*a)) or taken[-1])
    got = OP(q, codes, codes, idx, 0.05, sparse_block_size=block, sparse_mode=mode, **args)
    if sfa_native.native.load(sfa.NATIVE_SOURCE):
        assert taken and all(taken)
    ref = sfa.reference_sparse_flash_attention(q, codes, codes, idx, 0.05, sparse_block_size=block,
                                               sparse_mode=mode, **args)
    assert_outputs_close(got, ref, atol=1e-2, rtol=1e-2)
    monkeypatch.setattr(sfa_native, "native_gathered", lambda *a: False)
    per_row = OP(q, codes, codes, idx, 0.05, sparse_block_size=block, sparse_mode=mode, **args)
    assert_outputs_close(got, per_row, atol=1e-2, rtol=1e-2)


def test_fp8_decode_token_with_no_selected_row_is_empty():
    q, codes, args = fp8_case(1, 64, False, torch.bfloat16)
    idx = torch.full((2, 1, 1, 10), -1, dtype=torch.int32)
    idx[1, 0, 0, :3] = torch.tensor([5, 5, 40])     # a position listed twice counts twice
    out, smax, ssum = OP(q, codes, codes, idx, 0.05, **args)
    assert out[0].eq(0).all() and smax[0].eq(float("-inf")).all() and ssum[0].eq(0).all()
    ref = sfa.reference_sparse_flash_attention(q, codes, codes, idx, 0.05, **args)
    assert_outputs_close((out, smax, ssum), ref, atol=1e-2, rtol=1e-2)

"""The blocked torch path of ascend_dsa::sparse_flash_attention (many query tokens in batched GEMMs) against the
fp32 reference: ragged lengths, -1 entries anywhere, causal and unmasked, blocks of positions, paged caches, a
value distinct from the key, bf16, rows without keys, and a NaN in a row only masked slots gather."""
import pytest
import torch

from npu_graph.kernels.native import dispatch
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.sparse_attention import blocked
from npu_graph.kernels.sparse_attention import sparse_flash_attention as sfa
from npu_graph.kernels.sparse_attention import torch_path as sfa_torch
from tests.kernels.test_sparse_flash_attention import assert_outputs_close, make_inputs, random_indices, to_paged

OP = torch.ops.ascend_dsa.sparse_flash_attention


@pytest.fixture
def blocked_path(monkeypatch):
    """The torch path, its blocks small enough that a call spans several of them; counts the blocked calls."""
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    monkeypatch.setattr(blocked, "BLOCK_ELEMS", 2048)
    calls = []
    real = blocked._attend_block
    monkeypatch.setattr(blocked, "_attend_block", lambda *a: calls.append(a[2].shape[0]) or real(*a))
    return calls


def call_both(q, kv, value, idx, scale, **kwargs):
    return OP(q, kv, value, idx, scale, **kwargs), sfa.reference_sparse_flash_attention(q, kv, value, idx, scale,
                                                                                       **kwargs)


CASES = [  # batch, s1, n1, dl, dr, s2, k, sparse_mode, sparse_block_size, pad
    (2, 20, 4, 64, 16, 50, 16, 3, 1, 3),
    (1, 17, 2, 32, 0, 40, 12, 0, 1, 0),
    (1, 16, 2, 32, 8, 64, 6, 3, 4, 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("large_pv_elems", [0, 1 << 62], ids=["bf16_pv", "fp32_pv"])
def test_blocked_matches_reference(case, dtype, large_pv_elems, blocked_path, monkeypatch):
    monkeypatch.setattr(sfa_torch, "LARGE_PV_ELEMS", large_pv_elems)
    monkeypatch.setattr(sfa_torch, "onednn_bf16", lambda: True)
    batch, s1, n1, dl, dr, s2, k, mode, block, pad = case
    q, kv, qr, kr = make_inputs(batch, s1, n1, dl, dr, s2, dtype)
    idx = random_indices(batch, s1, s2 // block, k, pad=pad)
    idx[..., ::5] = -1                                          # -1 entries anywhere, not only at the end
    got, want = call_both(q, kv, kv, idx, (dl + dr) ** -0.5, query_rope=qr, key_rope=kr, sparse_mode=mode,
                          sparse_block_size=block)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_outputs_close(got, want, atol=tol, rtol=tol)
    assert len(blocked_path) > batch                            # several blocks per batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_ragged_paged_distinct_value(dtype, blocked_path):
    q, kv, qr, kr = make_inputs(2, 24, 4, 32, 8, 70, dtype, seed=3)
    value = torch.randn_like(kv)
    idx = random_indices(2, 24, 70, 20, seed=4, pad=4)
    idx[0, 3] = -1                                              # a row with nothing selected
    kv_cache, table = to_paged(kv, 16)
    value_cache, _ = to_paged(value, 16)
    rope_cache, _ = to_paged(kr, 16)
    lengths = dict(actual_seq_lengths_query=torch.tensor([24, 18]), actual_seq_lengths_kv=torch.tensor([70, 51]))
    got = OP(q, kv_cache, value_cache, idx, 0.2, table, query_rope=qr, key_rope=rope_cache,
             layout_kv="PA_BSND", **lengths)
    want = sfa.reference_sparse_flash_attention(q, kv, value, idx, 0.2, query_rope=qr, key_rope=kr, **lengths)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_outputs_close(got, want, atol=tol, rtol=tol)
    assert torch.isneginf(got[1][0, 3]).all() and (got[0][0, 3] == 0).all() and (got[2][0, 3] == 0).all()
    assert blocked_path


def test_blocked_nan_in_a_row_only_masked_slots_gather(blocked_path):
    """Masked slots gather row 0; a NaN there must not reach the output, as in the reference."""
    q, kv, qr, kr = make_inputs(1, 16, 2, 32, 8, 40, seed=5)
    idx = random_indices(1, 16, 40, 10, seed=6)
    idx[idx == 0] = 1
    idx[..., -2:] = -1
    kv[0, 0] = float("nan")
    got, want = call_both(q, kv, kv, idx, 0.3, query_rope=qr, key_rope=kr)
    assert not got[0].isnan().any()
    assert_outputs_close(got, want)


def test_a_prefill_call_is_measured_on_its_first_rows(monkeypatch, tmp_path):
    """The measured dispatch times a call of more than PROBE_ROWS query tokens on its first PROBE_ROWS, then runs
    the chosen path over all of them."""
    if not native.load(sfa.NATIVE_SOURCE):
        pytest.skip("the native kernel does not load here")
    monkeypatch.setenv(native.ENV_SWITCH, "auto")
    monkeypatch.setattr(dispatch, "table_path", lambda: tmp_path / "dispatch-test.json")
    for name in ("_table", "_known", "_provisional"):
        monkeypatch.setattr(dispatch, name, None if name == "_table" else {})
    monkeypatch.setattr(sfa, "_PLANS", sfa.call_plans.Plans(sfa.OP))
    timed = []
    real = dispatch._measure
    monkeypatch.setattr(dispatch, "_measure", lambda *a: timed.append(a) or real(*a))
    seen = []
    real_batches = sfa._batches_cpu
    monkeypatch.setattr(sfa, "_batches_cpu", lambda q, *a: seen.append(q.shape[1]) or real_batches(q, *a))
    q, kv, qr, kr = make_inputs(1, sfa.PROBE_ROWS + 8, 2, 32, 8, 60, seed=7)
    idx = random_indices(1, sfa.PROBE_ROWS + 8, 60, 10, seed=8)
    got, want = call_both(q, kv, kv, idx, 0.3, query_rope=qr, key_rope=kr)
    assert_outputs_close(got, want)
    assert len(timed) == 1 and seen[-1] == sfa.PROBE_ROWS + 8 and seen.count(sfa.PROBE_ROWS + 8) == 1
    assert set(seen[:-1]) == {sfa.PROBE_ROWS}


@pytest.mark.parametrize("paged", [False, True])
def test_blocked_fp8_kv_and_rope_key(paged, blocked_path):
    """FP8 latent rows with per-tile scales and an FP8 RoPE key with one scale per token, dequantized as gathered."""
    q, kv, qr, kr = make_inputs(1, 20, 4, 256, 64, 80, torch.bfloat16, seed=16)
    codes, scale = torch.ops.ascend_dsa.dynamic_block_quant(kv.float(), block_size=128)
    rope_codes, rope_scale = torch.ops.ascend_dsa.dynamic_block_quant(kr.float(), block_size=64)
    idx = random_indices(1, 20, 80, 30, seed=17, pad=2)
    args = dict(query_rope=qr, key_scale=scale, value_scale=scale, key_rope=rope_codes, key_rope_scale=rope_scale)
    if paged:
        (codes, table), scale = to_paged(codes, 16), to_paged(scale, 16)[0]
        rope_codes, rope_scale = (to_paged(x, 16)[0] for x in (rope_codes, rope_scale))
        args.update(block_table=table, key_scale=scale, value_scale=scale, key_rope=rope_codes,
                    key_rope_scale=rope_scale, layout_kv="PA_BSND", actual_seq_lengths_kv=torch.tensor([80]))
    got, want = call_both(q, codes, codes, idx, 0.05, **args)
    assert_outputs_close(got, want, atol=1e-2, rtol=1e-2)
    assert blocked_path

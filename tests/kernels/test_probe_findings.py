"""Calls that once gave a silent wrong result or an error that did not name its argument: each now gives the
reference's result or a ValueError that names the argument, through the native kernels (at every level this CPU
executes) and the torch path alike."""
import math

import pytest
import torch
from native_paths import native_and_torch

from npu_graph.kernels.aten import dense_attention
from npu_graph.kernels.kda.chunk_kda import reference_chunk_kda
from npu_graph.kernels.moe.gating import reference_moe_gating_top_k
from npu_graph.kernels.sparse_attention.reference import reference_sparse_flash_attention

SFA = torch.ops.ascend_dsa.sparse_flash_attention
INDEXER = torch.ops.ascend_dsa.lightning_indexer
GATING = torch.ops.ascend_dsa.moe_gating_top_k
sfa_path = native_and_torch("sparse_attention")
indexer_path = native_and_torch("lightning_indexer")
gating_path = native_and_torch("moe_gating")


def _sfa_operands(seed=0, paged=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 4, 32, generator=g)
    key, value = (torch.randn(4, 16, 1, 32, generator=g) if paged else torch.randn(1, 64, 1, 32, generator=g)
                  for _ in range(2))
    indices = torch.randint(0, 64, (1, 1, 1, 8), dtype=torch.int32, generator=g)
    return q, key, value, indices


@pytest.mark.parametrize("paged", [False, True])
def test_sfa_value_other_than_key_after_a_shared_call(paged, sfa_path):
    """A call with `value` the very tensor `key` (MLA's shared latent) and a later call of the same signature with a
    distinct value: the second reads its own value."""
    q, key, value, indices = _sfa_operands(paged=paged)
    options = {"block_table": torch.arange(4, dtype=torch.int32).view(1, 4), "layout_kv": "PA_BSND"} if paged else {}
    for v in (key, value, key, value):
        got = SFA(q, key, v, indices, 0.2, **options)
        want = reference_sparse_flash_attention(q, key, v, indices, 0.2, **options)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("entry", [2 ** 32 + 1, -2 ** 32 + 2, 2 ** 40, 2 ** 31])
def test_indexer_int64_block_table_entries_do_not_wrap(entry, indexer_path):
    table = torch.tensor([[0, 1, 2, entry]])
    with pytest.raises(ValueError, match=r"`block_table`\[0\] refers to block .* outside the 4 blocks"):
        INDEXER(torch.randn(1, 1, 4, 32), torch.randn(4, 16, 1, 32), torch.randn(1, 1, 4), None,
                torch.tensor([64]), table, sparse_count=16, layout_key="PA_BSND")


@pytest.mark.parametrize("count", [2 ** 31, 2 ** 63 - 1])
def test_indexer_sparse_count_too_large_names_it(count, indexer_path):
    with pytest.raises(ValueError, match="`sparse_count`"):
        INDEXER(torch.randn(1, 1, 4, 32), torch.randn(1, 16, 1, 32), torch.randn(1, 1, 4), sparse_count=count)


def test_gating_refuses_a_nan_bias(gating_path):
    x, bias = torch.randn(4, 16), torch.randn(16)
    bias[3] = float("nan")
    with pytest.raises(ValueError, match=r"`bias` holds NaN at expert\(s\) \[3\]"):
        GATING(x, 4, bias)
    with pytest.raises(ValueError, match="`bias` holds NaN"):
        reference_moe_gating_top_k(x, 4, bias)


@pytest.mark.parametrize("norm_type", [0, 1])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_gating_non_finite_logits_and_infinite_bias_select_as_the_reference(norm_type, value, gating_path):
    g = torch.Generator().manual_seed(5)
    x, bias = torch.randn(3, 32, generator=g), torch.randn(32, generator=g)
    x[0, 7], x[2, 20], x[2, 3] = value, value, value
    if not math.isnan(value):
        bias[11] = value
    options = {"k_group": 2, "group_count": 4, "norm_type": norm_type, "renorm": 1}
    y, idx, norm = GATING(x, 4, bias, **options)
    ry, ridx, rnorm = reference_moe_gating_top_k(x, 4, bias, **options)
    assert torch.equal(idx, ridx)
    torch.testing.assert_close(y, ry, equal_nan=True)
    torch.testing.assert_close(norm, rnorm, equal_nan=True)


@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan")])
def test_sfa_refuses_a_non_finite_scale(scale, sfa_path):
    q, key, value, indices = _sfa_operands()
    with pytest.raises(ValueError, match="`scale_value` must be a finite number"):
        SFA(q, key, value, indices, scale)


@pytest.mark.parametrize("scale", [1e30, 1e38, -1e38])
def test_sfa_huge_scales_follow_the_non_finite_rule(scale, sfa_path):
    """The query is scaled first, on every path as in the reference: at 1e30 the logits stay finite, at ±1e38 every
    scaled query value overflows (|q| >= 4) and every head is NaN. (Between the two, whether a logit's sum
    overflows depends on the order of its additions.)"""
    q, key, value, indices = _sfa_operands(seed=1)
    if abs(scale) > 1e37:
        q = q.sign() * (4 + q.abs())
    got = SFA(q, key, value, indices, scale)
    want = reference_sparse_flash_attention(q, key, value, indices, scale)
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan())
        torch.testing.assert_close(a.nan_to_num(), b.nan_to_num())


def test_sfa_heads_whose_logits_are_all_minus_inf_select_nothing(sfa_path):
    q, key, value, indices = _sfa_operands()
    key[..., 0] = float("inf")
    q[0, 0, :, 0] = 1.0           # +inf logits: heads 0, 2 and 3 are NaN
    q[0, 0, 1] = 0.0
    q[0, 0, 1, 0] = -1.0          # head 1 scores -inf everywhere
    out, smax, ssum = SFA(q, key, value, indices, 0.2)
    assert bool((out[0, 0, 1] == 0).all()) and float(smax[0, 0, 1]) == float("-inf") and float(ssum[0, 0, 1]) == 0
    assert bool(out[0, 0, 0].isnan().all()) and bool(smax[0, 0, 0].isnan()) and bool(ssum[0, 0, 0].isnan())
    want = reference_sparse_flash_attention(q, key, value, indices, 0.2)
    for a, b in zip((out, smax, ssum), want):
        torch.testing.assert_close(a, b, equal_nan=True)


@pytest.mark.parametrize("start", [-3, 65, 2 ** 31 - 1])
def test_sfa_refuses_key_starts_outside_the_keys_as_the_indexer_does(start, sfa_path):
    q, key, value, indices = _sfa_operands()
    with pytest.raises(ValueError, match=r"`key_starts` \[.*\] fall outside the 64 keys"):
        SFA(q, key, value, indices, 0.2, key_starts=torch.tensor([start]))
    with pytest.raises(ValueError, match="fall outside the 64 keys"):
        INDEXER(torch.randn(1, 1, 4, 32), key, torch.randn(1, 1, 4), sparse_count=8, key_starts=torch.tensor([start]))


def test_kda_huge_chunk_size_is_the_same_math(monkeypatch):
    """chunk_size changes speed, not results: 2**40 runs as one chunk over the sequence, not a 140 TB one."""
    monkeypatch.setenv("ASCEND_DSA_NATIVE", "0")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 300, 2, 16, generator=g) for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    decay, beta = -torch.rand(1, 300, 2, 16, generator=g) * 0.2, torch.rand(1, 300, 2, generator=g)
    got = torch.ops.ascend_dsa.chunk_kda(q, k, v, decay, beta, chunk_size=2 ** 40)[0]
    torch.testing.assert_close(got, reference_chunk_kda(q, k, v, decay, beta)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("q_len,k_len", [(4, 0), (0, 5), (0, 0)])
def test_dense_attention_empty_lengths_return_sdpa_results(q_len, k_len):
    q, k = torch.randn(1, 2, q_len, 24), torch.randn(1, 2, k_len, 24)
    out, lse = dense_attention.flash_attention_for_cpu(q, k, k)
    assert out.shape == (1, 2, q_len, 24) and bool((out == 0).all()) and lse.shape == (1, 2, q_len)
    assert bool((lse == float("-inf")).all()) if k_len == 0 else True
    want = torch.nn.functional.scaled_dot_product_attention(q, k, k)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("shapes,message", [
    (((1, 4, 3, 24), (1, 3, 5, 24), (1, 3, 5, 24)), "4 heads must be a multiple of `key`'s 3"),
    (((1, 2, 3, 24), (1, 0, 5, 24), (1, 0, 5, 24)), "2 heads must be a multiple of `key`'s 0"),
    (((1, 2, 3, 24), (1, 2, 5, 16), (1, 2, 5, 24)), "`key`'s head dim 16 and `value`'s 24 must equal `query`'s 24"),
    (((1, 2, 3, 24), (1, 2, 5, 24), (1, 2, 6, 24)), "must share batch, heads and length"),
    (((2, 2, 3, 24), (1, 2, 5, 24), (1, 2, 5, 24)), "must share batch, heads and length"),
    (((2, 3, 24),), "`query` must be 4-D"),
])
def test_dense_attention_refuses_what_torch_kernel_would_crash_on(shapes, message):
    tensors = [torch.randn(s) for s in shapes] * (3 // len(shapes))
    with pytest.raises(ValueError, match=message):
        dense_attention.flash_attention_for_cpu(*tensors)


@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_dense_attention_strided_head_dim_is_read_right(which):
    g = torch.Generator().manual_seed(0)
    inputs = {name: torch.randn(1, 2, 70, 24, generator=g) for name in ("query", "key", "value")}
    want = torch.nn.functional.scaled_dot_product_attention(*inputs.values())
    inputs[which] = torch.stack([inputs[which], inputs[which]], dim=-1)[..., 0]     # stride 2 along the head dim
    assert inputs[which].stride(3) == 2
    torch.testing.assert_close(dense_attention.flash_attention_for_cpu(**inputs)[0], want)

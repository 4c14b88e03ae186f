"""Inputs a careless or hostile caller passes to the fused ops: each raises a clear error or returns the right
result, through the native kernels (at every level this CPU executes) and the torch path alike; never a crash,
a hang or a silent wrap. Cases that once crashed the process run in a subprocess of their own."""
import os
import subprocess
import sys

import pytest
import torch
from native_paths import LEVELS, native_and_torch
from test_lightning_indexer import assert_same_topk

from npu_graph.kernels.aten import skinny_mm
from npu_graph.kernels.indexer import causal_lengths, lightning_indexer
from npu_graph.kernels.indexer import checks as indexer_checks
from npu_graph.kernels.kda.chunk_kda import reference_chunk_kda
from npu_graph.kernels.sparse_attention import reference as sfa_reference
from npu_graph.kernels.sparse_attention import sparse_flash_attention as sfa
from npu_graph.kernels.sparse_attention import torch_path as sfa_torch

SFA = torch.ops.ascend_dsa.sparse_flash_attention
INDEXER = torch.ops.ascend_dsa.lightning_indexer
KDA = torch.ops.ascend_dsa.chunk_kda
path = native_and_torch(sfa.NATIVE_SOURCE)

# Each prints the result's checksum on success; run with ASCEND_DSA_NATIVE / ASCEND_DSA_CPU_ISA set by the test.
ONCE_CRASHED = {
    "paged index whose product with the block size wraps": """
q = torch.randn(1, 1, 4, 32); cache = torch.randn(4, 8, 1, 32)
table = torch.arange(4, dtype=torch.int32).view(1, 4)
idx = torch.full((1, 1, 1, 4), -1, dtype=torch.int64); idx[..., 0] = 3 * 2 ** 60
out = SFA(q, cache, cache, idx, 0.1, table, sparse_block_size=4, layout_kv="PA_BSND")
assert bool((out[0] == 0).all()) and bool((out[1] == float("-inf")).all())   # selects nothing visible
""",
    "2**20 query heads, decode": """
q = torch.randn(1, 1, 2 ** 20, 16); kv = torch.randn(1, 40, 1, 16)
out = SFA(q, kv, kv, torch.randint(0, 40, (1, 1, 1, 8), dtype=torch.int32), 0.25)[0]
assert out.shape[2] == 2 ** 20 and bool(torch.isfinite(out).all())
""",
    "2**20 query heads, two tokens": """
q = torch.randn(1, 2, 2 ** 20, 16); kv = torch.randn(1, 40, 1, 16)
out = SFA(q, kv, kv, torch.randint(0, 40, (1, 2, 1, 8), dtype=torch.int32), 0.25, sparse_mode=0)[0]
assert bool(torch.isfinite(out).all())
""",
    "block size 2**40": """
q = torch.randn(1, 1, 4, 32); kv = torch.randn(1, 64, 1, 32)
got = SFA(q, kv, kv, torch.zeros(1, 1, 1, 2, dtype=torch.int64), 0.1, sparse_block_size=2 ** 40)[0]
want = SFA(q, kv, kv, torch.arange(64).view(1, 1, 1, 64), 0.1)[0]     # index 0 covers the whole context
torch.testing.assert_close(got, want)
""",
}


@pytest.mark.parametrize("where", ["torch", *LEVELS])
def test_sfa_cases_that_once_crashed(where):
    """All cases in one subprocess per path (importing torch costs seconds); it prints each case as it passes, so
    a crash names the case it happened in."""
    env = {**os.environ, "ASCEND_DSA_NATIVE": "0" if where == "torch" else "1"}
    if where != "torch":
        env["ASCEND_DSA_CPU_ISA"] = where
    program = ["import torch, npu_graph", "SFA = torch.ops.ascend_dsa.sparse_flash_attention"]
    for name, code in ONCE_CRASHED.items():
        program += [code, f"print({name!r}, flush=True)"]
    done = subprocess.run([sys.executable, "-c", "\n".join(program)], capture_output=True, text=True, timeout=300,
                          env=env)
    passed = done.stdout.splitlines()
    failed = next((name for name in ONCE_CRASHED if name not in passed), None)
    assert done.returncode == 0, f"{failed!r}: exit {done.returncode}: {done.stderr[-1500:]}"
    assert passed == list(ONCE_CRASHED)


def test_sfa_huge_block_positions_stay_bounded(path):
    """A block size past the context selects at most the context: no giant arange, no overflow."""
    positions = sfa_torch.row_positions(torch.tensor([0, 5, -1, 2 ** 62]), 2 ** 40, 100)
    assert torch.equal(positions, torch.arange(100))
    assert sfa_reference.reference_positions([0, 5, -1, 2 ** 62], 2 ** 40, 100) == list(range(100))


@pytest.mark.parametrize("shape", [(1, 1, 4, 0), (1, 1, 0, 32)])
def test_indexer_needs_heads_and_a_head_dim(shape, path):
    q = torch.randn(shape)
    key = torch.randn(1, 64, 1, shape[3])
    with pytest.raises(ValueError, match="at least one head and a head dim > 0"):
        INDEXER(q, key, torch.randn(shape[:3]), sparse_count=8)


def test_sfa_needs_a_head_dim(path):
    q, kv = torch.randn(1, 1, 4, 0), torch.randn(1, 64, 1, 0)
    with pytest.raises(ValueError, match=r"head dim Dl .* must be > 0"):
        SFA(q, kv, kv, torch.zeros(1, 1, 1, 4, dtype=torch.int64), 0.1)


def test_sfa_zero_heads_return_empty(path):
    q, kv = torch.randn(1, 1, 0, 32), torch.randn(1, 64, 1, 32)
    out, smax, ssum = SFA(q, kv, kv, torch.zeros(1, 1, 1, 4, dtype=torch.int64), 0.1)
    assert out.shape == (1, 1, 0, 32) and smax.shape == ssum.shape == (1, 1, 0)


def test_indexer_refuses_more_positions_than_int32(path):
    key = torch.empty(1, 1, 1, 8).expand(1, 2 ** 31 + 5, 1, 8)       # no memory: an expanded view
    with pytest.raises(ValueError, match="2147483653 positions; the int32 `sparse_indices`"):
        INDEXER(torch.randn(1, 1, 2, 8), key, torch.randn(1, 1, 2), sparse_count=4)
    assert indexer_checks.INT32_MAX == 2 ** 31 - 1


@pytest.mark.parametrize("dim", [1, 2])
def test_causal_lengths_refuses_int32_overflow(dim, path):
    shape = [1, 1, 1]
    shape[dim] = 2 ** 31 + 3
    mask = torch.ones(1, 1, 1, dtype=torch.bool).expand(*shape)
    with pytest.raises(ValueError, match=r"2147483651 .* int32 sequence lengths hold at most 2147483647"):
        torch.ops.ascend_dsa.causal_lengths(mask)
    assert causal_lengths.INT32_MAX == 2 ** 31 - 1


@pytest.mark.parametrize("fn,w_shape", [(skinny_mm.mm, (63, 32)), (skinny_mm.linear, (32, 63))])
def test_skinny_mm_mismatched_operands_raise_as_aten(fn, w_shape, path):
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        fn(torch.randn(2, 64), torch.randn(w_shape))


@pytest.mark.parametrize("where", ["key", "query", "weights"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_nan_scores_rank_first(where, dtype, path):
    """NaN reaches the scores it touches (ReLU keeps it, as torch.relu) and a NaN score ranks above every number,
    as torch.topk ranks it: a NaN key is kept first; NaN in a query or weight makes every score NaN."""
    g = torch.Generator().manual_seed(3)
    q, key, w = (torch.randn(s, generator=g).to(dtype) for s in ((1, 1, 16, 64), (1, 500, 1, 64), (1, 1, 16)))
    row = {"key": key[0, 37, 0], "query": q[0, 0, 3], "weights": w[0, 0]}[where]
    row[5] = float("nan")
    indices, values = INDEXER(q, key, w, sparse_count=8)
    if where == "key":
        assert int(indices[0, 0, 0, 0]) == 37 and bool(values[0, 0, 0, 0].isnan())
        assert_same_topk((indices[..., 1:], values[..., 1:]),
                         tuple(x[..., 1:] for x in lightning_indexer.reference_lightning_indexer(q, key, w,
                                                                                              sparse_count=8)))
    else:
        assert bool(values.isnan().all()) and bool(((indices >= 0) & (indices < 500)).all())


def _kda_inputs(t_len=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, h, dk, dv = 1, 2, 16, 8
    q, k = torch.randn(b, t_len, h, dk, generator=g), torch.randn(b, t_len, h, dk, generator=g)
    k = torch.nn.functional.normalize(k, dim=-1)
    v, beta = torch.randn(b, t_len, h, dv, generator=g), torch.rand(b, t_len, h, generator=g)
    return q, k, v, -torch.rand(b, t_len, h, dk, generator=g) * 0.2, beta


kda_path = native_and_torch("kda")


@pytest.mark.parametrize("t_len", [5, 40])          # the step path (<= 16 steps) and the chunked form
def test_kda_minus_inf_decay_resets_the_state(t_len, kda_path):
    q, k, v, g, beta = _kda_inputs(t_len)
    g[:, 3, 1] = float("-inf")
    o, s = KDA(q, k, v, g, beta, output_final_state=True)
    ro, rs = reference_chunk_kda(q, k, v, g, beta, output_final_state=True)
    assert bool(torch.isfinite(o).all())
    torch.testing.assert_close(o, ro, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, rs, rtol=1e-4, atol=1e-4)


def test_kda_refuses_a_positive_log_decay(kda_path):
    q, k, v, g, beta = _kda_inputs()
    g[0, 7, 1, 2] = 0.25
    with pytest.raises(ValueError, match=r"`g` is a log decay and must be <= 0 .* g\[0, 7, 1, 2\] = 0.25"):
        KDA(q, k, v, g, beta)


@pytest.mark.parametrize("name", ["q", "k", "v", "beta"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("t_len", [5, 40])
def test_kda_non_finite_inputs_reach_only_later_steps(name, bad, t_len, kda_path):
    inputs = dict(zip(("q", "k", "v", "g", "beta"), _kda_inputs(t_len)))
    step = 3 if t_len == 5 else 12
    inputs[name][0, step, 0] = bad
    o = KDA(**inputs)[0]
    ro = reference_chunk_kda(**inputs)[0]
    assert torch.equal(torch.isfinite(o), torch.isfinite(ro))
    assert bool(torch.isfinite(o[:, :step]).all())
    finite = torch.isfinite(ro)
    torch.testing.assert_close(o[finite], ro[finite], rtol=1e-4, atol=1e-4)


def test_indexer_prefilter_keeps_nan_and_masks_minus_inf(monkeypatch):
    """The bf16 prefilter of the torch path (taken on CPUs with bf16 GEMMs, forced here) keeps a NaN key first and
    reports a key scoring -inf as -1."""
    monkeypatch.setenv("ASCEND_DSA_NATIVE", "0")
    monkeypatch.setattr(lightning_indexer, "bf16_prefilter", lambda: True)
    g = torch.Generator().manual_seed(4)
    q, key = torch.randn(1, 1, 4, 32, generator=g).bfloat16(), torch.randn(1, 300, 1, 32, generator=g).bfloat16()
    key[0, 37, 0, 3] = float("nan")
    indices, values = INDEXER(q, key, torch.ones(1, 1, 4).bfloat16(), sparse_count=8)
    assert int(indices[0, 0, 0, 0]) == 37 and bool(values[0, 0, 0, 0].isnan())
    key[0, 5:] = float("inf")           # with positive queries and a weight of -1 these keys score -inf
    indices, values = INDEXER(q.abs(), key, -torch.ones(1, 1, 4).bfloat16(), sparse_count=8)
    assert sorted(indices[0, 0, 0, :5].tolist()) == [0, 1, 2, 3, 4] and bool((indices[0, 0, 0, 5:] == -1).all())
    assert bool((values[0, 0, 0, 5:] == float("-inf")).all())

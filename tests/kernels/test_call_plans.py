"""kernels/native/call_plans: a fused op's second call of a signature runs the stored plan and gives the full path's
result bit for bit; changing the native settings, a profiler, or dispatch.take_used sends the next call down the
full path again; checks on data still run on planned calls."""
import itertools

import pytest
import torch

from npu_graph.kernels.checks import FusedPreconditionError
from npu_graph.kernels.indexer import native as li_native
from npu_graph.kernels.native import call_plans, dispatch
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.rowwise import rms_norm as rms_module
from npu_graph.kernels.sparse_attention import plan as sfa_plan
from npu_graph.kernels.sparse_attention import sparse_flash_attention as sfa

OPS = torch.ops.ascend_dsa


def planned(plans: call_plans.Plans, fn, *args, **kwargs):
    """fn's results on a first call (full path) and on a second one, and whether the second found a plan."""
    first = fn(*args, **kwargs)
    stored = len(plans)
    hits = []
    original = plans.get

    def counting(signature):
        plan = original(signature)
        hits.append(plan is not None)
        return plan

    plans.get = counting
    try:
        second = fn(*args, **kwargs)
    finally:
        del plans.get
    return first, second, stored and hits == [True]


def same(a, b) -> bool:
    a, b = (a,) if isinstance(a, torch.Tensor) else a, (b,) if isinstance(b, torch.Tensor) else b
    return all(x.dtype == y.dtype and x.stride() == y.stride() and torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_planned_call_equals_the_full_path(switch, monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, switch)
    x, gamma = torch.randn(2, 64), torch.rand(64)
    first, second, hit = planned(rms_module._PLANS, OPS.rms_norm, x, gamma, 1e-6)
    assert hit and same(first, second)


def test_a_changed_setting_is_planned_again(monkeypatch):
    x, gamma = torch.randn(1, 32), torch.rand(32)
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    OPS.rms_norm(x, gamma)
    assert len(rms_module._PLANS) == 1
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    OPS.rms_norm(x, gamma)
    assert len(rms_module._PLANS) == 2


def test_another_thread_count_is_planned_again(monkeypatch, torch_threads):
    """A plan holds the implementation dispatch measured at the thread count of its first call: after
    torch.set_num_threads the call is planned (and measured) again."""
    x, gamma = torch.randn(1, 32), torch.rand(32)
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    OPS.rms_norm(x, gamma)
    assert len(rms_module._PLANS) == 1
    torch_threads(1 if torch.get_num_threads() > 1 else 2)
    OPS.rms_norm(x, gamma)
    assert len(rms_module._PLANS) == 2


def test_profiling_and_take_used_take_the_full_path():
    x, gamma = torch.randn(1, 32), torch.rand(32)
    OPS.rms_norm(x, gamma)
    with torch.profiler.profile() as prof:
        OPS.rms_norm(x, gamma)
    assert any("ascend_dsa::rms_norm/" in e.name for e in prof.events())     # dispatch.run's event
    dispatch.take_used()
    assert len(rms_module._PLANS) == 0
    OPS.rms_norm(x, gamma)
    assert "rms_norm" in dispatch.take_used()


def sfa_case(batch, s1, value_shared, rope, pad_starts, heads_first=False):
    """heads_first: query (and rope) [B, S1, N1, D] views of [B, N1, S1, D] tensors, as a model's attention
    transposes them (the plan copies them)."""
    g = torch.Generator().manual_seed(batch * 10 + s1)
    q = torch.randn(batch, 4, s1, 32, generator=g).transpose(1, 2) if heads_first else torch.randn(batch, s1, 4, 32,
                                                                                                   generator=g)
    kv = torch.randn(batch, 40, 1, 32, generator=g)
    value = kv if value_shared else torch.randn(batch, 40, 1, 32, generator=g)
    q_rope = torch.randn(batch, s1, 4, 8, generator=g) if rope else None
    q_rope = q_rope.transpose(1, 2).contiguous().transpose(1, 2) if rope and heads_first else q_rope
    k_rope = torch.randn(batch, 40, 1, 8, generator=g) if rope else None
    idx = torch.stack([torch.randperm(40, generator=g)[:8] for _ in range(batch * s1)]).view(batch, s1, 1, 8)
    lengths_q = torch.tensor([s1] + [max(s1 - 1, 0)] * (batch - 1), dtype=torch.int32)
    lengths_kv = torch.tensor([40] + [33] * (batch - 1), dtype=torch.int32)
    starts = torch.tensor([0] + [5] * (batch - 1), dtype=torch.int32) if pad_starts else None
    return (q, kv, value, idx.to(torch.int32), 0.17, None, lengths_q, lengths_kv, q_rope, k_rope, None, None, starts)


@pytest.mark.parametrize(("batch", "s1", "value_shared", "rope", "pad_starts", "heads_first"), [
    (1, 1, True, True, False, False), (3, 2, True, True, True, False), (2, 3, False, False, False, False),
    (2, 1, False, True, True, False), (2, 5, True, True, True, True), (1, 4, False, False, False, True)])
def test_sparse_attention_plans_equal_the_full_path(batch, s1, value_shared, rope, pad_starts, heads_first):
    args = sfa_case(batch, s1, value_shared, rope, pad_starts, heads_first)
    assert sfa_plan.takes(args[0], args[8])
    first, second, hit = planned(sfa._PLANS, OPS.sparse_flash_attention, *args, sparse_mode=3)
    assert hit and same(first, second)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sparse_attention_plans_take_16_bit_queries(dtype, monkeypatch):
    """A bf16 or fp16 query (and KV) takes the one-call plan, widened to fp32 and its output rounded back, with
    results equal to the full path's (bf16 with the bf16 dot products where the build has them, in both)."""
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    args = [x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for x in sfa_case(2, 3, False, True, False, True)]
    assert sfa_plan.takes(args[0], args[8])
    first, second, hit = planned(sfa._PLANS, OPS.sparse_flash_attention, *args, sparse_mode=3)
    assert hit and same(first, second) and first[0].dtype is dtype


def test_planned_sparse_attention_still_checks_its_data():
    args = list(sfa_case(1, 1, True, True, False))
    OPS.sparse_flash_attention(*args)
    args[3] = args[3].clone()
    args[3][..., 0] = -2                  # an index below -1
    with pytest.raises(ValueError, match="sparse_indices"):
        OPS.sparse_flash_attention(*args)
    args = list(sfa_case(1, 1, True, True, False))
    args[7] = torch.tensor([41], dtype=torch.int32)          # more keys than the cache holds
    with pytest.raises(ValueError, match="actual_seq_lengths_kv"):
        OPS.sparse_flash_attention(*args)


def test_planned_sparse_attention_refuses_padding_with_blocks_of_positions():
    """key_starts (a left-padded batch) need sparse_block_size 1: the plan's native call refuses a start > 0 with
    blocks of positions, with the full path's FusedPreconditionError."""
    args = list(sfa_case(2, 1, True, True, True))
    args[3] = args[3] // 4                              # entries of 4 positions each, within the 40 rows
    args[-1] = torch.zeros(2, dtype=torch.int32)
    for _ in range(2):                                  # the full path, then the plan
        OPS.sparse_flash_attention(*args, sparse_block_size=4)
    args[-1] = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(FusedPreconditionError, match="sparse_block_size 1"):
        OPS.sparse_flash_attention(*args, sparse_block_size=4)


def indexer_inputs(batch, s1, keys, heads=4, dim=16, paged=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, s1, heads, dim, generator=g)
    weights = torch.randn(batch, s1, heads, generator=g)
    if not paged:
        return query, torch.randn(batch, keys, 1, dim, generator=g), weights, None
    block, blocks = 16, -(-keys // 16)
    cache = torch.randn(batch * blocks + 1, block, 1, dim, generator=g)
    table = torch.randperm(batch * blocks + 1, generator=g)[:batch * blocks].view(batch, blocks).int()
    return query, cache, weights, table


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize(("batch", "s1"), [(1, 1), (2, 1), (2, 3)])
def test_indexer_plans_serve_a_growing_cache_and_equal_the_full_path(monkeypatch, paged, batch, s1):
    """A decode graph's key cache grows by a row per step: one plan serves every length of a dispatch bucket,
    and each planned call equals the full path (ASCEND_DSA_NATIVE=1, plans cleared before it) bit for bit."""
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    from npu_graph.kernels.indexer import lightning_indexer as li

    query, key, weights, table = indexer_inputs(batch, s1, 40, paged=paged)
    layout = {"layout_key": "PA_BSND"} if paged else {}

    def call(keys, n):
        lengths = torch.tensor([n - 1, n][:batch], dtype=torch.int32)
        return OPS.lightning_indexer(query, keys, weights, None, lengths, table, sparse_count=8, **layout)

    call(key if paged else key[:, :33].contiguous(), 33)
    assert len(li._PLANS) == 1
    original, hits = li._PLANS.get, []
    monkeypatch.setattr(li._PLANS, "get", lambda signature: hits.append(original(signature)) or hits[-1])
    for n in (34, 35, 40):
        keys = key if paged else key[:, :n].contiguous()
        planned_out = call(keys, n)
        assert hits[-1] is not None                     # the plan stored at length 33
        call_plans.clear_all()
        assert same(planned_out, call(keys, n))


def test_planned_indexer_still_checks_its_data(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    query, key, weights, _ = indexer_inputs(1, 1, 20)
    OPS.lightning_indexer(query, key, weights, None, torch.tensor([20], dtype=torch.int32), sparse_count=8)
    with pytest.raises(ValueError, match="actual_seq_lengths_key"):
        OPS.lightning_indexer(query, key, weights, None, torch.tensor([21], dtype=torch.int32), sparse_count=8)


@pytest.mark.parametrize("shared", [True, False])
def test_sparse_attention_plans_serve_a_growing_cache(monkeypatch, shared):
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    g = torch.Generator().manual_seed(3)
    query, q_rope = torch.randn(2, 1, 4, 32, generator=g), torch.randn(2, 1, 4, 16, generator=g)
    kv_all, v_all, rope_all = (torch.randn(2, 50, 1, d, generator=g) for d in (32, 32, 16))
    indices = torch.randint(0, 30, (2, 1, 1, 8), generator=g, dtype=torch.int32)

    def call(n):
        kv, rope = kv_all[:, :n].contiguous(), rope_all[:, :n].contiguous()
        value = kv if shared else v_all[:, :n].contiguous()
        return OPS.sparse_flash_attention(query, kv, value, indices, 0.2, None, None, None, q_rope, rope)

    call(30)
    original, hits = sfa._PLANS.get, []
    monkeypatch.setattr(sfa._PLANS, "get", lambda signature: hits.append(original(signature)) or hits[-1])
    for n in (31, 40, 50):
        planned_out = call(n)
        assert hits[-1] is not None
        call_plans.clear_all()
        assert same(planned_out, call(n))


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("rows", [40, 1])
def test_planned_indexer_rows_equal_torch_topk_of_the_native_scores(monkeypatch, ties, rows):
    """A prefill's rows go to the threads in one native call (li_rows_topk), a decode row's keys to them
    (li_row_topk); rows whose k-th and (k+1)-th scores are equal (all-zero scores after the ReLU) are settled by
    torch.topk. Each row keeps the keys torch.topk keeps of the row's native scores in a row as long as the keys
    (masked keys at -inf, as in an eager model's score matrix; rows past a batch's query length: none), on the
    first call and on the planned ones."""
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    query, key, weights, _ = indexer_inputs(2, rows, 40, seed=5)
    if ties:
        query = -query.abs()
        key = key.abs()                                 # every q·k < 0: every score is 0
    lq, lk = [rows, rows - 1 if rows > 1 else 0], [40, 37]
    args = (query, key, weights, torch.tensor(lq, dtype=torch.int32), torch.tensor(lk, dtype=torch.int32))
    score = li_native.row_scorer(query, key, None)
    for _ in range(2):                              # the first call, then the plan
        indices = OPS.lightning_indexer(*args, sparse_count=8)[0]
        for b, t in itertools.product(range(2), range(rows)):
            want = torch.full((8,), -1, dtype=torch.int32)
            visible = min(max(lk[b] - lq[b] + t + 1, 0), lk[b])      # causal, bottom-right aligned
            if t < lq[b] and visible:
                row = torch.full((40,), float("-inf"))
                row[:visible] = score(b, visible, query[b, t], weights[b, t])
                top = row.topk(8)
                want = top.indices.int().masked_fill(top.values == float("-inf"), -1)
            assert torch.equal(indices[b, t, 0].sort().values, want.sort().values), (b, t)


@pytest.mark.parametrize("batch", [1, 2])
def test_paged_sparse_attention_plans_equal_the_full_path(monkeypatch, batch):
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    g = torch.Generator().manual_seed(4)
    blocks, block = 3 * batch + 1, 16
    query, q_rope = torch.randn(batch, 1, 4, 32, generator=g), torch.randn(batch, 1, 4, 16, generator=g)
    cache, rope = torch.randn(blocks, block, 1, 32, generator=g), torch.randn(blocks, block, 1, 16, generator=g)
    table = torch.randperm(blocks, generator=g)[:3 * batch].view(batch, 3).int()
    indices = torch.randint(0, 40, (batch, 1, 1, 8), generator=g, dtype=torch.int32)
    lengths = torch.tensor([40, 45][:batch], dtype=torch.int32)

    def call():
        return OPS.sparse_flash_attention(query, cache, cache, indices, 0.2, table, None, lengths, q_rope, rope,
                                          layout_kv="PA_BSND")

    first, second, hit = planned(sfa._PLANS, call)
    assert hit and same(first, second)
    with pytest.raises(ValueError):
        OPS.sparse_flash_attention(query, cache, cache, indices, 0.2, table, None, lengths + 100, q_rope, rope,
                                   layout_kv="PA_BSND")
    bad_table = table.clone()
    bad_table[0, 0] = blocks                        # a block the cache does not have
    with pytest.raises(ValueError, match="block_table"):
        OPS.sparse_flash_attention(query, cache, cache, indices, 0.2, bad_table, None, lengths, q_rope, rope,
                                   layout_kv="PA_BSND")
    wide = indices.long().repeat_interleave(2, -1)[..., ::2]     # int64, not contiguous: the plan reads a copy
    for _ in range(2):                                             # the full path, then the plan
        torch.testing.assert_close(OPS.sparse_flash_attention(query, cache, cache, wide, 0.2, table, None, lengths,
                                                              q_rope, rope, layout_kv="PA_BSND"), first)


@pytest.mark.parametrize("switch", ["1", "0"])
def test_chunk_kda_plans_equal_the_full_path(monkeypatch, switch):
    from npu_graph.kernels.kda import chunk_kda as kda

    monkeypatch.setenv(native.ENV_SWITCH, switch)
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(1, 1, 2, 16, generator=g), torch.randn(1, 1, 2, 16, generator=g)
    v, decay = torch.randn(1, 1, 2, 8, generator=g), -torch.rand(1, 1, 2, 16, generator=g)
    beta, state = torch.rand(1, 1, 2, generator=g), torch.randn(1, 2, 16, 8, generator=g)

    def call():
        return OPS.chunk_kda(q, k, v, decay, beta, None, state, output_final_state=True)

    first, second, hit = planned(kda._PLANS, call)
    assert hit and same(first, second)
    with pytest.raises(ValueError, match="log decay"):
        OPS.chunk_kda(q, k, v, -decay, beta, None, state, output_final_state=True)


def test_indexer_prefill_rows_shared_by_the_threads_equal_one_thread(monkeypatch, torch_threads):
    """Enough prefill work (64 rows of up to 4096 keys) for li_rows_topk to share the rows among the threads: the
    same top-k as with one thread."""
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    query, key, weights, _ = indexer_inputs(1, 64, 4096, heads=8, dim=32, seed=7)
    torch_threads(1)
    alone = OPS.lightning_indexer(query, key, weights, sparse_count=64)
    call_plans.clear_all()
    torch_threads(2)
    shared = OPS.lightning_indexer(query, key, weights, sparse_count=64)
    assert same(alone, shared)


@pytest.mark.parametrize("switch", ["1", "0"])
@pytest.mark.parametrize(("rows", "special"), [(1, None), (4, None), (1, float("nan"))])
def test_router_plans_equal_the_full_path(switch, rows, special, monkeypatch):
    """moe_gating_top_k's plan (the normalisation, then the native selection or torch's) gives the full path's
    results bit for bit, a non-finite score included (the native entry declines it, the torch path answers)."""
    from npu_graph.kernels.moe import gating as moe_gating
    monkeypatch.setenv(native.ENV_SWITCH, switch)
    monkeypatch.setattr(moe_gating, "_PLANS", call_plans.Plans(moe_gating.OP))
    x, bias = torch.randn(rows, 64), torch.randn(64)
    if special is not None:
        x[0, 5] = special
    first, second, hit = planned(moe_gating._PLANS, OPS.moe_gating_top_k, x, 6, bias, k_group=4, group_count=8,
                                 group_select_mode=1, routed_scaling_factor=2.5)
    assert hit
    for a, b in zip(first, second, strict=True):                    # NaN scores give NaN weights in both
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

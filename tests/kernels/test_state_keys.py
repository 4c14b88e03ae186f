"""State the fused ops keep between calls is keyed on everything it depends on (DESIGN.md, "State kept between
calls"): for each cache, a call that stores its entry, then a call that differs only in an input the key leaves
out (data, the address of the same data, aliasing, a growing cache's length), which must give a fresh result."""
import ast
import inspect

import pytest
import torch
from test_lightning_indexer import assert_same_topk

from npu_graph.kernels import attn_res, checks
from npu_graph.kernels.aten import skinny_mm
from npu_graph.kernels.indexer import causal_lengths
from npu_graph.kernels.indexer import checks as indexer_checks
from npu_graph.kernels.indexer import reference as indexer_reference
from npu_graph.kernels.kda import checks as kda_checks
from npu_graph.kernels.kda import chunk_kda
from npu_graph.kernels.moe import fused_moe, gating
from npu_graph.kernels.native import call_plans, cpu_isa, dispatch
from npu_graph.kernels.rowwise import rms_norm, rotary_mul
from npu_graph.kernels.sparse_attention import checks as sfa_checks
from npu_graph.kernels.sparse_attention import reference as sfa_reference

OPS = torch.ops.ascend_dsa
G = torch.Generator().manual_seed(11)


def randn(*shape):
    return torch.randn(shape, generator=G)


def sfa_changes():
    key, value, cache = randn(1, 40, 1, 32), randn(1, 40, 1, 32), randn(1, 60, 1, 32)
    table = torch.tensor([[2, 0, 1, 3]], dtype=torch.int32)
    paged = randn(4, 8, 1, 32)
    q, idx = randn(1, 1, 4, 32), torch.randint(0, 30, (1, 1, 1, 6), dtype=torch.int32, generator=G)
    paged_opts = {"block_table": table, "layout_kv": "PA_BSND"}

    def call(q, k, v, idx, **kw):
        return (lambda: OPS.sparse_flash_attention(q, k, v, idx, 0.2, **kw),
                lambda: sfa_reference.reference_sparse_flash_attention(q, k, v, idx, 0.2, **kw))
    grown = cache[:, :52]
    return {f"sparse_flash_attention: {name}": calls for name, calls in {
        "value is key, then a distinct value": [call(q, key, key, idx), call(q, key, value, idx)],
        "a view of key as value, then key itself": [call(q, key, key.view(key.shape), idx), call(q, key, key, idx)],
        "a growing cache's length": [call(q, cache[:, :40], cache[:, :40], idx), call(q, grown, grown, idx + 10)],
        "the same data at another address": [call(q, cache[:, :40], cache[:, :40], idx),
                                             call(q, cache[:, 5:45], cache[:, 5:45], idx)],
        "a reshuffled block table": [call(q, paged, paged, idx, **paged_opts),
                                     call(q, paged, paged, idx, **{**paged_opts, "block_table": table.flip(1)})],
    }.items()}


def indexer_changes():
    cache, paged = randn(1, 90, 1, 32), randn(4, 16, 1, 32)
    table = torch.tensor([[3, 1, 0, 2]])
    q, w = randn(1, 1, 4, 32), randn(1, 1, 4)

    def call(k, weights, **kw):
        kw = {"sparse_count": 12, **kw}
        return (lambda: OPS.lightning_indexer(q, k, weights, **kw),
                lambda: indexer_reference.reference_lightning_indexer(q, k, weights, **kw))
    return {
        "lightning_indexer: a growing cache's length": [call(cache[:, :40], w), call(cache[:, :50], w)],
        "lightning_indexer: weights expanded, then not": [call(cache, w[..., :1].expand(w.shape)), call(cache, w)],
        "lightning_indexer: a reshuffled block table": [call(paged, w, block_table=table, layout_key="PA_BSND"),
                                     call(paged, w, block_table=table.flip(1), layout_key="PA_BSND")],
    }


def rowwise_changes():
    x, gamma, other = randn(3, 64), randn(64), randn(64)
    x1, x2 = randn(2, 48), randn(2, 48)
    cos, sin, xr = randn(1, 3, 1, 16), randn(1, 3, 1, 16), randn(2, 3, 2, 16)

    def norm(x, gamma):
        return lambda: OPS.rms_norm(x, gamma, 1e-6), lambda: rms_norm.reference_rms_norm(x, gamma, 1e-6)

    def add(a, b):
        return lambda: OPS.add_rms_norm(a, b, gamma[:48], 1e-6), \
            lambda: rms_norm.reference_add_rms_norm(a, b, gamma[:48], 1e-6)

    def rotary(r1, r2):
        return lambda: OPS.rotary_mul(xr, r1, r2), lambda: rotary_mul.reference_rotary_mul(xr, r1, r2)
    buffer = randn(4, 64)
    return {
        "rms_norm: another gamma": [norm(x, gamma), norm(x, other)],
        "rms_norm: rows at another offset": [norm(buffer[:3], gamma), norm(buffer[1:], gamma)],
        "add_rms_norm: x2 is x1, then another x2": [add(x1, x1), add(x1, x2)],
        "rotary_mul: r2 is r1, then another r2": [rotary(cos, cos), rotary(cos, sin)],
    }


def moe_changes():
    x, bias, other = randn(3, 16), randn(16), randn(16)
    w13, w2 = randn(4, 12, 8) * 0.3, randn(4, 8, 6) * 0.3
    xm, ids, tw = randn(3, 8), torch.tensor([[0, 2], [1, 3], [2, 0]]), torch.rand(3, 2, generator=G)

    def gate(b):
        return lambda: OPS.moe_gating_top_k(x, 4, b), lambda: gating.reference_moe_gating_top_k(x, 4, b)

    def experts(a, b, topk_ids):
        return lambda: OPS.fused_moe(xm, a, b, tw, topk_ids), \
            lambda: fused_moe.reference_fused_moe(xm, a, b, tw, topk_ids)
    return {
        "moe_gating_top_k: another bias": [gate(bias), gate(other)],
        "fused_moe: other weights": [experts(w13, w2, ids), experts(w13.flip(0), w2.flip(0), ids)],
        "fused_moe: other ids": [experts(w13, w2, ids), experts(w13, w2, ids.flip(0))],
    }


def sequence_changes():
    q, k, v = randn(1, 6, 2, 8), torch.nn.functional.normalize(randn(1, 6, 2, 8), dim=-1), randn(1, 6, 2, 4)
    g, beta, s0, s1 = -torch.rand(1, 6, 2, 8, generator=G) * 0.3, torch.rand(1, 6, 2, generator=G), \
        randn(1, 2, 8, 4), randn(1, 2, 8, 4)
    mask = torch.ones(2, 3, 10, dtype=torch.bool).tril(7)
    later = mask.clone()
    later[1, :, :4] = False
    blocks, queries = randn(3, 1, 2, 16), randn(2, 16)
    w, wt = randn(24, 40), randn(40, 24)
    xs = randn(3, 40)

    def kda(query, state):
        return lambda: OPS.chunk_kda(query, k, v, g, beta, initial_state=state, output_final_state=True), \
            lambda: chunk_kda.reference_chunk_kda(query, k, v, g, beta, initial_state=state, output_final_state=True)

    def lengths(m):
        return lambda: OPS.causal_lengths(m, False, True), \
            lambda: causal_lengths.reference_causal_lengths(m, False, True)

    def depth(partial):
        return lambda: OPS.attn_res(blocks, partial, queries), \
            lambda: attn_res.reference_attn_res(blocks, partial, queries)
    return {
        "chunk_kda: q is k, then another q": [kda(k, s0), kda(q, s0)],
        "chunk_kda: another initial state": [kda(q, s0), kda(q, s1)],
        "causal_lengths: another mask": [lengths(mask), lengths(later)],
        "attn_res: partial is a block, then another": [depth(blocks[0]), depth(randn(1, 2, 16))],
        "skinny linear: another weight": [(lambda: skinny_mm.linear(xs, w), lambda: xs @ w.T),
                                          (lambda: skinny_mm.linear(xs, w.flip(0)), lambda: xs @ w.flip(0).T)],
        "skinny mm: another weight": [(lambda: skinny_mm.mm(xs, wt), lambda: xs @ wt),
                                      (lambda: skinny_mm.mm(xs, wt.flip(1)), lambda: xs @ wt.flip(1))],
    }


CHANGES = {**sfa_changes(), **indexer_changes(), **rowwise_changes(), **moe_changes(), **sequence_changes()}


def assert_same(got, want, name):
    if name.startswith("lightning_indexer"):
        assert_same_topk(got, want)
        return
    got, want = (x if isinstance(x, tuple) else (x,) for x in (got, want))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.to(b.dtype), b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["1", "0"])
@pytest.mark.parametrize("name", list(CHANGES))
def test_plans_serve_a_changed_unkeyed_input_freshly(name, mode, monkeypatch):
    monkeypatch.setenv("ASCEND_DSA_NATIVE", mode)
    call_plans.clear_all()
    for run, reference in CHANGES[name]:
        for _ in range(2):          # the first call of a signature stores its plan, the second runs it
            assert_same(run(), reference(), name)


STATIC_CHECKS = [indexer_checks.check_static, sfa_checks.check_static, kda_checks.validate, gating._validate,
                 fused_moe._validate, rms_norm._check, rotary_mul._check, attn_res._validate]
READS_MORE_THAN_THE_KEY = {"stride", "is_contiguous", "data_ptr", "storage_offset", "untyped_storage", "tolist",
                           "item", "any", "all", "min", "max", "requires_grad"}


@pytest.mark.parametrize("check", STATIC_CHECKS, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_checks_passed_once_read_only_what_their_key_holds(check):
    """checks.once_per_signature keys a passed check by its tensors' shapes, dtypes and devices and its other
    arguments' values: a check (and the module functions it calls) must read nothing else of a tensor."""
    module = inspect.getmodule(check.__wrapped__)
    tree = ast.parse(inspect.getsource(module))
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    todo, seen, read = [check.__wrapped__.__name__], set(), set()
    while todo:
        name = todo.pop()
        if name in seen or name not in functions:
            continue
        seen.add(name)
        for node in ast.walk(functions[name]):
            if isinstance(node, ast.Attribute):
                read.add(node.attr)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                todo.append(node.func.id)
    assert not read & READS_MORE_THAN_THE_KEY, f"{check.__name__} reads {read & READS_MORE_THAN_THE_KEY}"


def test_a_check_passed_once_still_checks_other_options():
    q, key, w = randn(1, 1, 4, 32), randn(1, 64, 1, 32), randn(1, 1, 4)
    OPS.lightning_indexer(q, key, w, sparse_count=8)
    with pytest.raises(ValueError, match="sparse_mode"):
        OPS.lightning_indexer(q, key, w, sparse_count=8, sparse_mode=2)
    assert checks.MAX_SIGNATURES > 0


def test_dispatch_choices_are_kept_per_level_and_thread_count(monkeypatch):
    levels = cpu_isa.supported()
    cls = dispatch.shape_class("state-keys", 7)
    monkeypatch.setenv(cpu_isa.ENV_ISA, levels[0])
    slot = dispatch._slot("op", cpu_isa.active(), cls)
    monkeypatch.setenv(cpu_isa.ENV_ISA, levels[-1])
    assert dispatch._slot("op", cpu_isa.active(), cls) != slot or len(levels) == 1
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, threads - 1) if threads > 1 else 2)
        assert dispatch._slot("op", levels[0], cls) != slot
    finally:
        torch.set_num_threads(threads)

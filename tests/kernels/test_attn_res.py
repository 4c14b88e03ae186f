"""ascend_dsa::attn_res: the two-phase fast path against the naive softmax over depth (shapes, dtypes,
optional partial and norm weight, token tiles), the laws (zero queries average, the online merge of the
partial equals treating it as one more block, RMSNorm scale invariance), opcheck, torch.compile, errors."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from npu_graph.kernels import attn_res as attn_res_module
from npu_graph.kernels.attn_res import block_phase, merge_partial, reference_attn_res
from npu_graph.kernels.native import loader as native

OPS = torch.ops.ascend_dsa
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def make_inputs(n, b, t, d, s, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randn(n, b, t, d, generator=g) * torch.rand(n, 1, 1, 1, generator=g) * 4
    partial = torch.randn(b, t, d, generator=g)
    queries = torch.randn(s, d, generator=g)
    weight = torch.rand(d, generator=g) + 0.5
    return blocks.to(dtype), partial.to(dtype), queries.to(dtype), weight.to(dtype)


def assert_matches_reference(blocks, partial, queries, weight, eps=1e-6, tol=None):
    out = OPS.attn_res(blocks, partial, queries, weight, eps=eps)
    ref = reference_attn_res(blocks, partial, queries, weight, eps=eps)
    assert out.dtype == blocks.dtype and out.shape == (queries.shape[0], *blocks.shape[1:])
    rtol, atol = tol or TOL[blocks.dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize(("n", "b", "t", "d", "s"), [(3, 2, 5, 16, 4), (1, 1, 1, 8, 1), (8, 1, 64, 32, 3),
                                                      (0, 2, 3, 8, 2), (5, 3, 17, 64, 6)])
@pytest.mark.parametrize("with_partial", [True, False])
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("direct_rows", "native_on"), [(0, True), (1 << 30, True), (1 << 30, False)],
                         ids=["two_phase", "direct_native", "direct_torch"])
def test_fast_matches_reference(n, b, t, d, s, with_partial, with_weight, dtype, direct_rows, native_on,
                                isa_level, monkeypatch):
    if not native_on:
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    if n == 0 and not with_partial:
        pytest.skip("nothing to attend over")
    monkeypatch.setattr(attn_res_module, "_DIRECT_ROWS", direct_rows)
    blocks, partial, queries, weight = make_inputs(n, b, t, d, s, dtype=dtype)
    assert_matches_reference(blocks, partial if with_partial else None, queries, weight if with_weight else None)


def test_fp16_and_a_larger_eps():
    blocks, partial, queries, weight = make_inputs(4, 2, 9, 32, 3, seed=1, dtype=torch.float16)
    assert_matches_reference(blocks, partial, queries, weight, eps=1e-2)


def test_many_token_tiles(monkeypatch):
    monkeypatch.setattr(attn_res_module, "_TILE_ELEMENTS", 200)
    blocks, partial, queries, weight = make_inputs(3, 2, 37, 16, 4, seed=2)
    assert_matches_reference(blocks, partial, queries, weight)
    assert_matches_reference(blocks, None, queries, None)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 6), t=st.integers(1, 9), d=st.integers(1, 24), s=st.integers(1, 5),
       spread=st.floats(0.01, 30.0), seed=st.integers(0, 2 ** 16))
def test_equals_naive_softmax_over_depth(n, t, d, s, spread, seed):
    blocks, partial, queries, weight = make_inputs(n, 2, t, d, s, seed=seed)
    # logits of size ~spread*sqrt(d) carry fp32 rounding of that size into the softmax weights
    tol = 5e-6 * (1 + spread)
    assert_matches_reference(blocks, partial, queries * spread, weight, tol=(tol, tol))


def test_zero_queries_give_the_plain_mean():
    blocks, partial, _, weight = make_inputs(5, 2, 7, 16, 1, seed=3)
    queries = torch.zeros(3, 16)
    mean = torch.cat((blocks, partial[None])).mean(dim=0)
    torch.testing.assert_close(OPS.attn_res(blocks, partial, queries, weight), mean.expand(3, -1, -1, -1))
    torch.testing.assert_close(OPS.attn_res(blocks, None, queries, None), blocks.mean(dim=0).expand(3, -1, -1, -1))


def test_online_merge_equals_one_more_block():
    blocks, partial, queries, weight = make_inputs(4, 2, 6, 16, 3, seed=4)
    merged = OPS.attn_res(blocks, partial, queries, weight)
    torch.testing.assert_close(merged, OPS.attn_res(torch.cat((blocks, partial[None])), None, queries, weight))


def test_block_phase_is_shared_by_several_partials():
    """Phase (a) once, then one merge per layer with that layer's partial."""
    blocks, _, queries, weight = make_inputs(3, 1, 8, 16, 2, seed=5)
    stats = block_phase(blocks.flatten(1, 2), queries, weight)
    for seed in range(3):
        partial = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(seed))
        out = merge_partial(stats, partial.flatten(0, 1), queries, weight).view(2, 1, 8, 16)
        torch.testing.assert_close(out, reference_attn_res(blocks, partial, queries, weight))


@pytest.mark.parametrize("factor", [10.0, 0.1])
def test_rms_norm_makes_the_weights_scale_invariant(factor):
    """With eps=0 the depth weights only see directions, so scaling every value scales the output."""
    blocks, partial, queries, weight = make_inputs(3, 1, 4, 8, 2, seed=6)
    out = OPS.attn_res(blocks, partial, queries, weight, eps=0.0)
    scaled = OPS.attn_res(blocks * factor, partial * factor, queries, weight, eps=0.0)
    torch.testing.assert_close(scaled, out * factor)


def test_opcheck():
    blocks, partial, queries, weight = make_inputs(3, 2, 4, 8, 2, seed=7)
    torch.library.opcheck(OPS.attn_res.default, (blocks, partial, queries, weight), {"eps": 1e-5})
    torch.library.opcheck(OPS.attn_res.default, (blocks, None, queries, None))


def test_compiles_fullgraph_dynamic():
    def f(blocks, partial, queries, weight):
        return OPS.attn_res(blocks, partial, queries, weight) + 1
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="eager")
    for n, t in ((3, 5), (4, 11)):
        args = make_inputs(n, 2, t, 8, 2, seed=t)
        torch.testing.assert_close(compiled(*args), f(*args))


@pytest.mark.parametrize(("change", "match"), [
    (lambda a: {**a, "blocks": a["blocks"][0]}, "`blocks` must have rank 4"),
    (lambda a: {**a, "queries": a["queries"][:, :4]}, "hidden size D of `queries`"),
    (lambda a: {**a, "partial": a["partial"][:, :2]}, "shape of `partial`"),
    (lambda a: {**a, "partial": a["partial"].double()}, "dtypes of `partial` and `blocks`"),
    (lambda a: {**a, "norm_weight": a["norm_weight"][:3]}, "size of `norm_weight`"),
    (lambda a: {**a, "blocks": a["blocks"][:0], "partial": None}, "nothing to attend over"),
    (lambda a: {**a, "blocks": a["blocks"].int()}, "`blocks` has dtype torch.int32"),
])
def test_clear_errors(change, match):
    blocks, partial, queries, weight = make_inputs(2, 1, 3, 8, 2)
    args = change({"blocks": blocks, "partial": partial, "queries": queries, "norm_weight": weight})
    with pytest.raises(ValueError, match=match):
        OPS.attn_res(**args)

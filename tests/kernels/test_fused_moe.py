"""ascend_dsa::fused_moe: grouped dispatch/GEMM/combine against the per-expert loop reference (dtypes,
decode T=1, experts nobody picked, an expert picked twice by a token), agreement with transformers'
expert loop, opcheck, torch.compile, errors."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native_paths import refuse

from npu_graph.kernels.moe import fused_moe, fused_moe_native
from npu_graph.kernels.moe.fused_moe import reference_fused_moe
from npu_graph.kernels.native import loader as native
from npu_graph.tools.bench_kernels_kda import expert_loop

OPS = torch.ops.ascend_dsa
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}


def make_inputs(tokens, hidden, inter, experts, top_k, seed=0, dtype=torch.float32, used=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    pool = used or experts
    ids = torch.argsort(torch.rand(tokens, pool, generator=g), dim=-1)[:, :top_k]
    weights = torch.rand(tokens, top_k, generator=g)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids.int()


def assert_matches_reference(*args):
    out = OPS.fused_moe(*args)
    ref = reference_fused_moe(*args)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    rtol, atol = TOL[args[0].dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize(("tokens", "hidden", "inter", "experts", "top_k"), [
    (37, 64, 32, 8, 3), (1, 32, 16, 16, 4), (5, 16, 8, 4, 1), (64, 48, 24, 32, 8), (0, 16, 8, 4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fast_matches_reference(tokens, hidden, inter, experts, top_k, dtype):
    assert_matches_reference(*make_inputs(tokens, hidden, inter, experts, top_k, dtype=dtype))


def test_experts_nobody_picked_and_int64_ids():
    x, w13, w2, weights, ids = make_inputs(20, 32, 16, 16, 2, seed=1, used=4)
    assert ids.max() < 4
    assert_matches_reference(x, w13, w2, weights, ids.long())


def test_an_expert_picked_twice_counts_twice():
    x, w13, w2, _, _ = make_inputs(3, 16, 8, 4, 2, seed=2)
    ids = torch.tensor([[1, 1], [0, 2], [3, 3]], dtype=torch.int32)
    weights = torch.tensor([[0.25, 0.5], [1.0, 0.0], [0.5, 0.5]])
    out = OPS.fused_moe(x, w13, w2, weights, ids)
    single = OPS.fused_moe(x, w13, w2, weights.sum(-1, keepdim=True), ids[:, :1])
    torch.testing.assert_close(out[[0, 2]], single[[0, 2]])
    assert_matches_reference(x, w13, w2, weights, ids)
    one_token = OPS.fused_moe(x[:1], w13, w2, weights[:1], ids[:1])       # the decode path
    torch.testing.assert_close(one_token, single[:1])
    assert_matches_reference(x[:1], w13, w2, weights[:1], ids[:1])


def test_bf16_routing_weights():
    x, w13, w2, weights, ids = make_inputs(9, 32, 16, 8, 2, seed=3)
    torch.testing.assert_close(OPS.fused_moe(x, w13, w2, weights.bfloat16(), ids),
                               reference_fused_moe(x, w13, w2, weights.bfloat16().float(), ids))


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(0, 24), experts=st.integers(1, 12), data=st.data(), seed=st.integers(0, 2 ** 16))
def test_equals_expert_loop(tokens, experts, data, seed):
    top_k = data.draw(st.integers(1, experts))
    assert_matches_reference(*make_inputs(tokens, 16, 8, experts, top_k, seed=seed))


def test_matches_transformers_expert_loop():
    args = make_inputs(50, 64, 32, 16, 4, seed=4)
    torch.testing.assert_close(OPS.fused_moe(*args), expert_loop(*args), rtol=1e-5, atol=1e-5)


def test_opcheck():
    args = make_inputs(6, 16, 8, 4, 2, seed=5)
    torch.library.opcheck(OPS.fused_moe.default, args)
    torch.library.opcheck(OPS.fused_moe.default, make_inputs(1, 16, 8, 4, 2, seed=6, dtype=torch.bfloat16))


def test_compiles_fullgraph_dynamic():
    def f(x, w13, w2, weights, ids):
        return OPS.fused_moe(x, w13, w2, weights, ids) + x
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="eager")
    for tokens in (3, 10):
        args = make_inputs(tokens, 16, 8, 4, 2, seed=tokens)
        torch.testing.assert_close(compiled(*args), f(*args))


@pytest.mark.parametrize(("change", "match"), [
    (lambda a: {**a, "x": a["x"][:, :8]}, "hidden size H of `x`"),
    (lambda a: {**a, "w13": a["w13"][:, :15]}, "odd 2I=15"),
    (lambda a: {**a, "w2": a["w2"][:, :, :4]}, "shape of `w2`"),
    (lambda a: {**a, "w2": a["w2"].double()}, "dtypes of `w2` and `x`"),
    (lambda a: {**a, "topk_ids": a["topk_ids"].float()}, "`topk_ids` has dtype torch.float32"),
    (lambda a: {**a, "topk_weights": a["topk_weights"][:, :1]}, "shape of `topk_weights` and `topk_ids`"),
    (lambda a: {**a, "topk_ids": a["topk_ids"][:2], "topk_weights": a["topk_weights"][:2]}, "token count T"),
    (lambda a: {**a, "topk_ids": a["topk_ids"] + 3}, r"must lie in \[0, 4\)"),
    (lambda a: {**a, "topk_ids": a["topk_ids"] - 5}, r"must lie in \[0, 4\)"),
    (lambda a: {**a, "x": a["x"][0]}, "`x` must have rank 2"),
])
def test_clear_errors(change, match):
    x, w13, w2, weights, ids = make_inputs(5, 16, 8, 4, 2)
    args = change({"x": x, "w13": w13, "w2": w2, "topk_weights": weights, "topk_ids": ids})
    with pytest.raises(ValueError, match=match):
        OPS.fused_moe(**args)


@pytest.mark.parametrize("shift", [3, -5])
def test_a_single_token_with_an_expert_out_of_range_says_which_values(shift):
    """The one-token (decode) path checks the ids it reads for its loop: the same error, values included."""
    x, w13, w2, weights, ids = make_inputs(1, 16, 8, 4, 2)
    ids = ids + shift
    low, high = int(ids.min()), int(ids.max())
    with pytest.raises(ValueError, match=rf"must lie in \[0, 4\); got values in \[{low}, {high}\]"):
        OPS.fused_moe(x, w13, w2, weights, ids)


native_moe = pytest.mark.skipif(not fused_moe_native.kernel(), reason="the native fused_moe kernel is not built")


def native_only(monkeypatch):
    """ASCEND_DSA_NATIVE=1 and both torch paths refused: a passing call ran the native kernel."""
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    refuse(monkeypatch, fused_moe, "_fused_moe_one_token", said="took the Python loop")
    refuse(monkeypatch, fused_moe, "_grouped", said="took the grouped torch path")


@native_moe
@pytest.mark.usefixtures("isa_level")
@pytest.mark.parametrize(("hidden", "inter", "experts", "top_k", "twice"), [
    (64, 32, 8, 2, False), (16, 8, 4, 1, False), (48, 24, 32, 8, False), (33, 7, 5, 3, True),
    (512, 256, 8, 2, False)])                     # the last one splits its products across the threads
def test_native_one_token_matches_reference(monkeypatch, hidden, inter, experts, top_k, twice):
    native_only(monkeypatch)
    x, w13, w2, weights, ids = make_inputs(1, hidden, inter, experts, top_k, seed=hidden)
    ids = ids.long()
    if twice:
        ids[0, -1] = ids[0, 0]
    out = OPS.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, reference_fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@native_moe
@pytest.mark.usefixtures("isa_level")
@pytest.mark.parametrize(("tokens", "hidden", "inter", "experts", "top_k"), [
    (2, 64, 32, 8, 2), (7, 33, 7, 5, 3), (64, 64, 32, 8, 2),
    (64, 512, 256, 8, 2)])                        # the last one shares its tokens across the threads
def test_native_tokens_match_reference(monkeypatch, tokens, hidden, inter, experts, top_k):
    """Several tokens in one call (a short prompt): each token as the one-token kernel does it."""
    native_only(monkeypatch)
    x, w13, w2, weights, ids = make_inputs(tokens, hidden, inter, experts, top_k, seed=tokens + hidden)
    out = OPS.fused_moe(x, w13, w2, weights, ids.long())
    torch.testing.assert_close(out, reference_fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@native_moe
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("shift", [3, -5])
def test_native_ids_out_of_range_say_which_values(monkeypatch, tokens, shift):
    native_only(monkeypatch)
    x, w13, w2, weights, ids = make_inputs(tokens, 16, 8, 4, 2)
    ids = ids.long() + shift
    low, high = int(ids.min()), int(ids.max())
    with pytest.raises(ValueError, match=rf"must lie in \[0, 4\); got values in \[{low}, {high}\]"):
        OPS.fused_moe(x, w13, w2, weights, ids)


@native_moe
def test_operands_the_kernel_does_not_read_take_the_python_loop(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    refuse(monkeypatch, fused_moe_native, "plan", said="took the native kernel")
    x, w13, w2, weights, ids = make_inputs(1, 16, 8, 4, 2)
    for case in ((x, w13, w2, weights, ids), (x, w13, w2, weights.bfloat16(), ids.long()),
                 (x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids.long())):
        torch.testing.assert_close(OPS.fused_moe(*case), reference_fused_moe(*case))

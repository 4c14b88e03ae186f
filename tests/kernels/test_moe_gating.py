"""ascend_dsa::moe_gating_top_k: the vectorized torch router and the native decode selection against a
brute-force per-token reference over group configurations, score functions and renorm modes, agreement with
the DeepSeek-V3 / Kimi router, output dtypes and shapes, tie-breaking, which path answers, opcheck,
torch.compile, errors."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native_paths import native_and_torch

from npu_graph.kernels.moe import gating as moe_gating
from npu_graph.kernels.moe import gating_native as moe_gating_native
from npu_graph.kernels.moe.gating import reference_moe_gating_top_k
from npu_graph.kernels.native import call_plans
from npu_graph.kernels.native import loader as native
from npu_graph.tools.bench_kernels_kda import grouped_router

OPS = torch.ops.ascend_dsa
LOADED, WHY = native.available(moe_gating_native.NATIVE_SOURCE)

path = native_and_torch(moe_gating_native.NATIVE_SOURCE)


def assert_matches_reference(x, k, bias=None, **kwargs):
    y, idx, out = OPS.moe_gating_top_k(x, k, bias, **kwargs)
    ry, ridx, rout = reference_moe_gating_top_k(x, k, bias, **kwargs)
    assert y.dtype == x.dtype and idx.dtype == torch.int32 and out.dtype == torch.float32
    assert y.shape == idx.shape == (x.shape[0], k) and out.shape == x.shape
    assert torch.equal(idx, ridx)
    torch.testing.assert_close(y, ry, rtol=1e-5 if x.dtype == torch.float32 else 1e-2, atol=1e-6)
    torch.testing.assert_close(out, rout)


CONFIGS = [
    {},
    {"k_group": 4, "group_count": 8, "group_select_mode": 1, "routed_scaling_factor": 2.5},
    {"k_group": 2, "group_count": 4, "group_select_mode": 0},
    {"norm_type": 0},
    {"norm_type": 0, "renorm": 1, "k_group": 3, "group_count": 8},
    {"k_group": 1, "group_count": 32, "group_select_mode": 0, "eps": 1e-6},
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_matches_brute_force(config, with_bias, dtype, path):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(40, 32, generator=g) * 2).to(dtype)
    bias = (torch.randn(32, generator=g) * 0.2).to(dtype) if with_bias else None
    assert_matches_reference(x, 1 if config.get("group_count") == 32 else 4, bias, **config)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), tokens=st.integers(0, 12), group_count=st.sampled_from([1, 2, 4, 8]),
       per_group=st.integers(2, 6), mode=st.sampled_from([0, 1]), norm_type=st.sampled_from([0, 1]),
       renorm=st.sampled_from([0, 1]), with_bias=st.booleans(), scale=st.floats(0.5, 3.0),
       seed=st.integers(0, 2 ** 16))
@pytest.mark.parametrize("native_on", [True, False], ids=["native", "torch"])
def test_equals_brute_force(data, tokens, group_count, per_group, mode, norm_type, renorm, with_bias, scale, seed,
                            native_on):
    experts = group_count * per_group
    k_group = data.draw(st.integers(1, group_count))
    k = data.draw(st.integers(1, k_group * per_group))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, experts, generator=g) * 3
    bias = torch.randn(experts, generator=g) * 0.3 if with_bias else None
    with pytest.MonkeyPatch.context() as patch:
        if not native_on:
            patch.setenv(native.ENV_SWITCH, "0")
        assert_matches_reference(x, k, bias, k_group=k_group, group_count=group_count, group_select_mode=mode,
                                 renorm=renorm, norm_type=norm_type, routed_scaling_factor=scale)


def test_matches_deepseek_v3_router():
    g = torch.Generator().manual_seed(1)
    logits, bias = torch.randn(64, 64, generator=g), torch.randn(64, generator=g) * 0.1
    y, idx, _ = OPS.moe_gating_top_k(logits, 6, bias, k_group=2, group_count=8, group_select_mode=1,
                                     norm_type=1, routed_scaling_factor=2.5)
    ref_y, ref_idx = grouped_router(logits, bias, 6, 8, 2, 2.5)
    order = ref_idx.argsort(dim=-1)
    mine = idx.long().argsort(dim=-1)
    assert torch.equal(idx.long().gather(1, mine), ref_idx.gather(1, order))
    torch.testing.assert_close(y.gather(1, mine), ref_y.gather(1, order))


def test_best_first_and_ties_to_the_lower_index(path):
    y, idx, _ = OPS.moe_gating_top_k(torch.zeros(2, 8), 3)
    assert idx.tolist() == [[0, 1, 2]] * 2
    torch.testing.assert_close(y, torch.full((2, 3), 1 / 3))
    x = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert OPS.moe_gating_top_k(x, 2)[1].tolist() == [[1, 3]]


def test_bias_steers_selection_but_not_weights(path):
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    y, idx, out = OPS.moe_gating_top_k(x, 2, bias, norm_type=1)
    assert idx.tolist() == [[3, 0]]
    sig = x.sigmoid()[0]
    torch.testing.assert_close(y[0], torch.stack((sig[3], sig[0])) / (sig[3] + sig[0]))
    torch.testing.assert_close(out, x.sigmoid())


def test_softmax_without_renorm_keeps_probabilities():
    x = torch.randn(5, 16)
    y, idx, _ = OPS.moe_gating_top_k(x, 4, norm_type=0, renorm=0)
    torch.testing.assert_close(y, torch.softmax(x, -1).gather(1, idx.long()))
    assert (y.sum(-1) < 1).all()


def test_opcheck():
    x, bias = torch.randn(6, 16), torch.randn(16)
    torch.library.opcheck(OPS.moe_gating_top_k.default, (x, 4, bias),
                          {"k_group": 2, "group_count": 4, "group_select_mode": 1, "routed_scaling_factor": 2.0})
    torch.library.opcheck(OPS.moe_gating_top_k.default, (x.bfloat16(), 2), {"norm_type": 0, "out_flag": True})


def test_compiles_fullgraph_dynamic():
    def f(x, bias):
        y, idx, _ = OPS.moe_gating_top_k(x, 4, bias, k_group=2, group_count=4, group_select_mode=1)
        return y * 2, idx
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="eager")
    bias = torch.randn(16)
    for tokens in (3, 9):
        x = torch.randn(tokens, 16)
        for got, want in zip(compiled(x, bias), f(x, bias)):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize(("args", "kwargs", "match"), [
    ((torch.randn(4, 16, 1), 2), {}, "`x` must have rank 2"),
    ((torch.randn(4, 16), 2, torch.randn(15)), {}, "size of `bias`"),
    ((torch.randn(4, 16), 2), {"group_count": 3}, "not divisible by `group_count`=3"),
    ((torch.randn(4, 16), 2), {"group_count": 4, "k_group": 5}, r"`k_group`=5 must be in \[1, group_count=4\]"),
    ((torch.randn(4, 16), 9), {"group_count": 4, "k_group": 2}, r"`k`=9 must be in \[1, .* = 8\]"),
    ((torch.randn(4, 16), 0), {}, "`k`=0"),
    ((torch.randn(4, 16), 2), {"group_select_mode": 2}, "`group_select_mode`=2 is not supported"),
    ((torch.randn(4, 16), 2), {"norm_type": 2}, "`norm_type`=2 is not supported"),
    ((torch.randn(4, 16), 2), {"renorm": 3}, "`renorm`=3 is not supported"),
    ((torch.randn(4, 16), 1), {"group_count": 16, "group_select_mode": 1}, "top-2 experts of a group"),
    ((torch.randint(0, 3, (4, 16)), 2), {}, "`x` has dtype torch.int64"),
])
def test_clear_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        OPS.moe_gating_top_k(*args, **kwargs)


@pytest.mark.parametrize("per_group", [2, 3, 32])
def test_top2_group_sum_equals_topk_with_ties(per_group):
    g = torch.Generator().manual_seed(per_group)
    grouped = torch.randint(0, 4, (64, 8, per_group), generator=g).float()   # many exact ties
    grouped[0, 0] = float("-inf")
    want = grouped.topk(2, dim=-1).values.sum(-1)
    assert torch.equal(moe_gating._top2_sum(grouped), want)


@pytest.mark.skipif(not LOADED, reason=f"native kernel not available: {WHY}")
@pytest.mark.parametrize(("rows", "experts", "special", "native_used"), [
    (1, 8, None, True), (4, 256, None, True), (300, 256, None, False), (1, 8, float("nan"), False),
    (1, 8, float("inf"), True)])
def test_which_path_answers(rows, experts, special, native_used, monkeypatch):
    """Decode-sized routers take the native selection (an infinite logit is a finite sigmoid score); large ones
    and non-finite scores the torch path (which orders NaN as torch.topk does); both agree with the reference."""
    answers = []
    planned = moe_gating_native.planned

    def recording(*args):
        entry = planned(*args)
        return None if entry is None else lambda norm, bias: answers.append(entry(norm, bias)) or answers[-1]

    monkeypatch.setattr(moe_gating_native, "planned", recording)
    monkeypatch.setattr(moe_gating, "_PLANS", call_plans.Plans(moe_gating.OP))     # no plan from another test
    x = torch.randn(rows, experts, generator=torch.Generator().manual_seed(rows))
    if special is not None:
        x[0, 3] = special
    y, idx, _ = OPS.moe_gating_top_k(x, 4, k_group=2, group_count=4, group_select_mode=1)
    ry, ridx, _ = reference_moe_gating_top_k(x, 4, k_group=2, group_count=4, group_select_mode=1)
    assert (bool(answers) and answers[0] is not None) == native_used
    if special is None or special == float("inf"):
        assert torch.equal(idx, ridx)
        torch.testing.assert_close(y, ry)

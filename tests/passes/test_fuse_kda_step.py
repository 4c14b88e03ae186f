"""fuse_kda_step on KDA recurrence steps written in torch: the op sets around the pass, the pattern counted,
outputs and new state equal to eager within fp32 rounding; operand orders, the reference model's step, near
misses (non-fp32 state, a step whose new state nobody reads with a query) and graphs left alone."""
import pytest
import torch

from npu_graph.models.kda import _kda_step, l2_normalize
from npu_graph.passes import fuse_kda_step

STEP_OPS = {"aten.bmm", "aten.exp"}


def inputs(b=2, h=3, dk=8, dv=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, h, dk, generator=g), torch.nn.functional.normalize(torch.randn(b, h, dk, generator=g), dim=-1)
    v, gate = torch.randn(b, h, dv, generator=g), -torch.rand(b, h, dk, generator=g)
    beta, state = torch.rand(b, h, generator=g), torch.randn(b, h, dk, dv, generator=g)
    return [x.to(dtype) for x in (q, k, v, gate, beta)] + [state.to(dtype)]


def swapped_step(q, k, v, g, beta, state):
    """The same step with every product's operands in the other order, and the scale applied to the output."""
    decayed = g.exp().unsqueeze(-1) * state
    delta = (v - torch.einsum("bhk,bhkv->bhv", k, decayed)) * beta.unsqueeze(-1)
    new = delta.unsqueeze(-2) * k.unsqueeze(-1) + decayed
    return torch.einsum("bhk,bhkv->bhv", q, new) * 0.5, new


def model_step(q, k, v, g, beta, state):
    o, new = _kda_step(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1), beta.unsqueeze(1), 0.25,
                       state)
    return o, new


def normalized_step(q, k, v, g, beta, state):
    """The reference model's decode step: q and k l2-normalised inside the step (each a product x·rsqrt(Σx²)), the
    query scaled."""
    return model_step(l2_normalize(q), l2_normalize(k), v, g, beta, state)


def assert_fused(watched):
    assert watched.stats["matches"] == {fuse_kda_step.PATTERN: 1}
    assert "ascend_dsa.chunk_kda" in watched.after_names and watched.before_names >= STEP_OPS
    assert not STEP_OPS & watched.after_names
    for got, want in zip(watched.out, watched.ref):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("step", [model_step, swapped_step, normalized_step],
                         ids=["reference_model", "swapped_operands", "normalized_query_and_key"])
@pytest.mark.parametrize("sizes", [(2, 3, 8, 5), (1, 8, 64, 64), (3, 1, 16, 40)])
def test_steps_become_chunk_kda(watch_pass, step, sizes):
    b, h, dk, dv = sizes
    assert_fused(watch_pass(fuse_kda_step, step, *inputs(b, h, dk, dv)))


def test_strong_decay_and_the_state_written_back(watch_pass):
    """The new state copied into a cache tensor (as the model's decode does; the harness runs eager, then the
    compiled step: two steps) and decays down to exp(-30)."""
    def step(q, k, v, g, beta, state):
        o, new = model_step(q, k, v, g * 30, beta, state)
        state.copy_(new)
        return o * 1.0
    args = inputs(seed=3)
    expected_state = args[5].clone()
    for _ in range(2):
        expected_state = model_step(*args[:3], args[3] * 30, args[4], expected_state)[1]
    watched = watch_pass(fuse_kda_step, step, *args)
    assert watched.stats["matches"] == {fuse_kda_step.PATTERN: 1}
    torch.testing.assert_close(args[5], expected_state, rtol=1e-5, atol=1e-5)


def test_bf16_inputs_cast_to_fp32_are_fused(watch_pass):
    """The reference model's step casts its bf16 inputs to fp32 first: the op takes the casts' outputs."""
    assert_fused(watch_pass(fuse_kda_step, model_step, *inputs(dtype=torch.bfloat16)[:5], inputs()[5]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_are_near_misses(watch_pass, dtype):
    """chunk_kda's state is fp32: steps computed in other dtypes are reported, not fused."""
    watched = watch_pass(fuse_kda_step, swapped_step, *inputs(dtype=dtype))
    assert watched.stats["matches"] == {} and "ascend_dsa.chunk_kda" not in watched.after_names
    assert watched.stats["near_misses"]


def test_broadcast_beta_is_expanded_over_the_heads(watch_pass):
    """A beta shared by the heads ([B, 1]) broadcasts in the step; the op gets it expanded to [B, H]."""
    q, k, v, g, beta, state = inputs()
    assert_fused(watch_pass(fuse_kda_step, swapped_step, q, k, v, g, beta[:, :1], state))


def test_a_correction_read_with_another_vector_than_the_key_is_a_near_miss(watch_pass):
    """v − q·S where the delta rule reads the state with the key it writes: another recurrence."""
    def other_read(q, k, v, g, beta, state):
        decayed = state * g.exp().unsqueeze(-1)
        delta = beta.unsqueeze(-1) * (v - torch.einsum("bhk,bhkv->bhv", q, decayed))
        new = decayed + k.unsqueeze(-1) * delta.unsqueeze(-2)
        return torch.einsum("bhk,bhkv->bhv", q, new), new

    watched = watch_pass(fuse_kda_step, other_read, *inputs())
    assert watched.stats["matches"] == {}
    assert any("key of the outer product" in miss["reason"] for miss in watched.stats["near_misses"])


def test_state_update_without_an_output_is_a_near_miss(watch_pass):
    def update_only(q, k, v, g, beta, state):
        return swapped_step(q, k, v, g, beta, state)[1]
    watched = watch_pass(fuse_kda_step, update_only, *inputs())
    assert watched.stats["matches"] == {}
    assert any("output products" in miss["reason"] for miss in watched.stats["near_misses"])


def test_unrelated_graph_unchanged(watch_pass):
    watched = watch_pass(fuse_kda_step, lambda a, b: (a + b).exp() @ b.t(), torch.randn(3, 4), torch.randn(3, 4))
    assert watched.stats["matches"] == {} and watched.stats["near_misses"] == []
    assert watched.before == watched.after

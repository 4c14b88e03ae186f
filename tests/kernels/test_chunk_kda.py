"""ascend_dsa::chunk_kda: its three CPU paths (native recurrence, chunked torch form, torch step loop) against the
step-by-step reference recurrence (shapes, dtypes, padding, strong decay), state hand-over and the segment
transition law, agreement with transformers' fallback, opcheck, torch.compile, errors."""
import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from npu_graph.kernels.kda import chunk_kda as chunk_kda_module
from npu_graph.kernels.kda import native as chunk_kda_native
from npu_graph.kernels.kda.chunk_kda import kda_transition, reference_chunk_kda
from npu_graph.kernels.native import loader as native

OPS = torch.ops.ascend_dsa


def transformers_chunk_fallback():
    """transformers' CPU `chunk_kimi_delta_attention`, imported after npu_graph (see npu_graph.routes)."""
    kimi = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
    return getattr(kimi.chunk_kimi_delta_attention, "__wrapped__", kimi.chunk_kimi_delta_attention)


def make_inputs(b, t, h, dk, dv, seed=0, decay=0.2, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=g)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=g), dim=-1)
    v = torch.randn(b, t, h, dv, generator=g)
    gate = -torch.rand(b, t, h, dk, generator=g) * decay
    beta = torch.rand(b, t, h, generator=g)
    return tuple(x.to(dtype) for x in (q, k, v, gate, beta))


@pytest.fixture(params=["native", "chunked", "stepwise_up_to_16"])
def path(request, monkeypatch):
    """Runs the test through the native recurrence (skipped where it cannot be built), and with it switched off
    through the chunked torch form, and through the torch step loop for sequences of at most 16 steps."""
    if request.param == "native":
        loaded, why = native.available(chunk_kda_native.NATIVE_SOURCE)
        if not loaded:
            pytest.skip(f"native kernel not available: {why}")
    else:
        monkeypatch.setenv(native.ENV_SWITCH, "0")
        monkeypatch.setattr(chunk_kda_module, "RECURRENT_MAX_T", 16 if request.param.startswith("stepwise") else 0)
    return request.param


def run(inputs, **kwargs):
    return OPS.chunk_kda(*inputs, **kwargs)


@pytest.mark.parametrize(("b", "t", "h", "dk", "dv", "chunk"), [
    (1, 128, 2, 32, 32, 64), (2, 100, 3, 16, 24, 64), (1, 1, 1, 8, 8, 64), (3, 77, 2, 8, 16, 16),
    (1, 64, 1, 16, 16, 64), (2, 130, 2, 16, 8, 32), (1, 9, 2, 4, 4, 1)])
@pytest.mark.parametrize("with_state", [False, True])
def test_fast_matches_recurrence(b, t, h, dk, dv, chunk, with_state, path):
    inputs = make_inputs(b, t, h, dk, dv)
    s0 = torch.randn(b, h, dk, dv) if with_state else None
    o, s = run(inputs, initial_state=s0, output_final_state=True, chunk_size=chunk)
    ro, rs = reference_chunk_kda(*inputs, initial_state=s0, output_final_state=True)
    assert o.shape == (b, t, h, dv) and s.shape == (b, h, dk, dv) and s.dtype == torch.float32
    torch.testing.assert_close(o, ro, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, rs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("decay", [5.0, 30.0])
def test_strong_decay_stays_exact(decay, path):
    """g down to -5 (and -30) per step: cumulative decays underflow exp, relative ones must not."""
    inputs = make_inputs(2, 150, 2, 16, 16, seed=3, decay=decay)
    o, s = run(inputs, output_final_state=True)
    ro, rs = reference_chunk_kda(*inputs, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, ro, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, rs, rtol=1e-4, atol=1e-4)


def test_constant_strong_decay_of_minus_five(path):
    q, k, v, _, beta = make_inputs(1, 200, 2, 16, 16, seed=4)
    inputs = (q, k, v, torch.full_like(q, -5.0), beta)
    torch.testing.assert_close(run(inputs)[0], reference_chunk_kda(*inputs)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_compute_in_fp32(dtype, path):
    inputs = make_inputs(2, 90, 2, 16, 16, seed=5, dtype=dtype)
    o, s = run(inputs, output_final_state=True)
    ro, rs = reference_chunk_kda(*inputs, output_final_state=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    torch.testing.assert_close(o, ro, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(s, rs, rtol=1e-4, atol=1e-4)


def test_scale_default_and_explicit(path):
    inputs = make_inputs(1, 40, 2, 16, 8, seed=6)
    torch.testing.assert_close(run(inputs)[0], run(inputs, scale=16 ** -0.5)[0])
    torch.testing.assert_close(run(inputs, scale=0.3)[0], reference_chunk_kda(*inputs, scale=0.3)[0],
                               rtol=1e-4, atol=1e-4)


def test_final_state_is_empty_unless_requested():
    o, s = run(make_inputs(1, 10, 1, 4, 4))
    assert s.shape == (0,) and s.dtype == torch.float32 and o.shape == (1, 10, 1, 4)


def test_chunk_size_does_not_change_the_result():
    inputs = make_inputs(2, 70, 2, 8, 8, seed=7)
    outs = [run(inputs, chunk_size=c, output_final_state=True) for c in (1, 8, 64, 128)]
    for o, s in outs[1:]:
        torch.testing.assert_close(o, outs[0][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(s, outs[0][1], rtol=1e-4, atol=1e-4)


@settings(max_examples=15, deadline=None)
@given(t=st.integers(2, 150), frac=st.floats(0.05, 0.95), chunk=st.sampled_from([8, 16, 64]),
       decay=st.sampled_from([0.05, 1.0, 5.0]), seed=st.integers(0, 2 ** 16))
@pytest.mark.parametrize("native_on", [True, False], ids=["native", "torch"])
def test_two_pieces_with_state_handed_over_equal_one_pass(t, frac, chunk, decay, seed, native_on):
    inputs = make_inputs(2, t, 2, 8, 8, seed=seed, decay=decay)
    cut = max(1, min(t - 1, int(t * frac)))
    with pytest.MonkeyPatch.context() as patch:
        if not native_on:
            patch.setenv(native.ENV_SWITCH, "0")
        o, s = run(inputs, output_final_state=True, chunk_size=chunk)
        o1, s1 = run([x[:, :cut] for x in inputs], output_final_state=True, chunk_size=chunk)
        o2, s2 = run([x[:, cut:] for x in inputs], initial_state=s1, output_final_state=True, chunk_size=chunk)
    torch.testing.assert_close(torch.cat((o1, o2), dim=1), o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s2, s, rtol=1e-4, atol=1e-4)


@settings(max_examples=15, deadline=None)
@given(t=st.integers(1, 140), chunk=st.sampled_from([4, 16, 64]), decay=st.sampled_from([0.1, 5.0]),
       seed=st.integers(0, 2 ** 16))
def test_transition_law(t, chunk, decay, seed):
    """final_state(S0) == A @ S0 + final_state(0) for any S0."""
    q, k, v, g, beta = make_inputs(2, t, 3, 8, 6, seed=seed, decay=decay)
    a, s_zero = kda_transition(k, v, g, beta, chunk_size=chunk)
    assert a.shape == (2, 3, 8, 8) and s_zero.shape == (2, 3, 8, 6)
    s0 = torch.randn(2, 3, 8, 6, generator=torch.Generator().manual_seed(seed))
    _, ref = reference_chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    torch.testing.assert_close(a @ s0 + s_zero, ref, rtol=1e-4, atol=1e-4)


def test_transitions_fold_across_ranks():
    """Each rank maps its segment; folding the maps left to right gives every rank's initial state."""
    q, k, v, g, beta = make_inputs(1, 120, 2, 8, 8, seed=8)
    bounds = [(0, 50), (50, 51), (51, 120)]
    state = torch.zeros(1, 2, 8, 8)
    outs = []
    for lo, hi in bounds:
        piece = [x[:, lo:hi] for x in (q, k, v, g, beta)]
        outs.append(run(piece, initial_state=state)[0])
        a, s_zero = kda_transition(*piece[1:])
        state = a @ state + s_zero
    ro, rs = reference_chunk_kda(q, k, v, g, beta, output_final_state=True)
    torch.testing.assert_close(torch.cat(outs, dim=1), ro, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, rs, rtol=1e-4, atol=1e-4)


def test_matches_transformers_chunk_fallback(path):
    fallback = transformers_chunk_fallback()
    inputs = make_inputs(2, 100, 2, 16, 16, seed=9)
    s0 = torch.randn(2, 2, 16, 16)
    ro, rs = fallback(*inputs, initial_state=s0, output_final_state=True)
    o, s = run(inputs, initial_state=s0, output_final_state=True)
    torch.testing.assert_close(o, ro, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, rs, rtol=1e-4, atol=1e-4)


def test_opcheck():
    inputs = make_inputs(1, 20, 2, 8, 4, seed=10)
    torch.library.opcheck(OPS.chunk_kda.default, inputs, {"output_final_state": True, "chunk_size": 8})
    torch.library.opcheck(OPS.chunk_kda.default, inputs, {"initial_state": torch.randn(1, 2, 8, 4)})


def test_compiles_fullgraph_dynamic():
    def f(q, k, v, g, beta, s0):
        o, s = OPS.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        return o * 2, s
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="eager")
    for t in (33, 70):
        inputs = make_inputs(2, t, 2, 8, 8, seed=t)
        s0 = torch.randn(2, 2, 8, 8)
        for got, want in zip(compiled(*inputs, s0), f(*inputs, s0)):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize(("change", "match"), [
    (lambda a: {**a, "q": a["q"][..., :4]}, "shapes of `q` and `k`"),
    (lambda a: {**a, "g": a["g"][:, :, :1]}, "shapes of `g` and `k`"),
    (lambda a: {**a, "beta": a["beta"][..., None]}, "`beta` must have rank 3"),
    (lambda a: {**a, "v": a["v"][:, :5]}, r"\[B,T,H\] of `v` and `k`"),
    (lambda a: {**a, "k": a["k"].int()}, "`k` has dtype torch.int32"),
    (lambda a: {**a, "chunk_size": 48}, "power of two"),
    (lambda a: {**a, "q": a["q"][..., :0], "k": a["k"][..., :0], "g": a["g"][..., :0]}, "head dim K of `k`"),
    (lambda a: {**a, "chunk_size": 0}, "`chunk_size` must be > 0"),
    (lambda a: {**a, "initial_state": torch.zeros(1, 2, 8, 5)}, "shape of `initial_state`"),
    (lambda a: {**a, "initial_state": torch.zeros(1, 2, 8, 8, dtype=torch.float64)}, "initial_state"),
])
def test_clear_errors(change, match):
    q, k, v, g, beta = make_inputs(1, 10, 2, 8, 8)
    args = change({"q": q, "k": k, "v": v, "g": g, "beta": beta})
    with pytest.raises(ValueError, match=match):
        OPS.chunk_kda(**args)


@pytest.mark.slow
def test_long_sequence_matches_transformers_fallback():
    fallback = transformers_chunk_fallback()
    inputs = make_inputs(1, 2048, 4, 128, 128, seed=11, decay=0.1)
    torch.testing.assert_close(run(inputs)[0], fallback(*inputs)[0], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 16])
def test_decode_steps_keep_the_callers_state(dtype, t, path):
    """Short sequences (decode) run step by step: equal to the recurrence, output in v's dtype, the caller's
    initial state left as it was."""
    inputs = make_inputs(2, t, 3, 16, 8, seed=t, dtype=dtype)
    s0 = torch.randn(2, 3, 16, 8)
    before = s0.clone()
    o, s = run(inputs, initial_state=s0, output_final_state=True)
    ro, rs = reference_chunk_kda(*inputs, initial_state=s0, output_final_state=True)
    assert o.dtype == dtype and torch.equal(s0, before)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o, ro, rtol=tol, atol=tol)
    torch.testing.assert_close(s, rs, rtol=1e-4, atol=1e-4)

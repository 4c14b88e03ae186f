"""ascend_dsa::chunk_kda through the native recurrence (kernels/native/kda.c) against the fp32 reference
recurrence: tile widths and key sizes around the vector and tile sizes, the lazy and the direct decay steps
(no decay, mild, strong, mixed per channel, decays that underflow), threaded and single-thread runs,
non-contiguous and half-precision inputs; and that the op takes this path, or the torch path when switched off."""
import pytest
import torch
from test_chunk_kda import make_inputs

from npu_graph.kernels.kda import native as chunk_kda_native
from npu_graph.kernels.kda.chunk_kda import reference_chunk_kda
from npu_graph.kernels.native import loader as native

OP = torch.ops.ascend_dsa.chunk_kda
LOADED, WHY = native.available(chunk_kda_native.NATIVE_SOURCE)
pytestmark = [pytest.mark.skipif(not LOADED, reason=f"native kernel not available: {WHY}"),
              pytest.mark.usefixtures("isa_level")]


def assert_matches_reference(inputs, s0=None, tol=1e-4, **kwargs):
    o, s = OP(*inputs, initial_state=s0, output_final_state=True, **kwargs)
    ro, rs = reference_chunk_kda(*inputs, initial_state=s0, output_final_state=True, **kwargs)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, ro, rtol=tol, atol=tol)
    torch.testing.assert_close(s, rs, rtol=1e-4, atol=1e-4)


@pytest.fixture
def calls(monkeypatch):
    """Records, per call of the op, whether the native kernel answered it."""
    answered = []
    kernel = chunk_kda_native.kernel

    def recording():
        fn = kernel()
        answered.append(fn is not None)
        return fn
    monkeypatch.setattr(chunk_kda_native, "kernel", recording)
    return answered


@pytest.mark.parametrize("dv", [1, 15, 16, 17, 33, 64, 100, 128, 129, 300])
def test_tile_widths(dv, calls):
    """One to eight vectors of columns per tile, several tiles, and partial ones."""
    assert_matches_reference(make_inputs(2, 40, 2, 16, dv, seed=dv), torch.randn(2, 2, 16, dv))
    assert calls == [True]


@pytest.mark.parametrize("dk", [1, 5, 16, 31, 130])
def test_key_sizes(dk):
    assert_matches_reference(make_inputs(1, 50, 3, dk, 24, seed=dk), torch.randn(1, 3, dk, 24))


@pytest.mark.parametrize("decay", [0.0, 0.01, 1.0, 5.0, 30.0, 200.0])
def test_decay_regimes(decay):
    """No decay (the tile is never rescaled), mild ones (long lazy runs), strong ones (direct steps), and
    decays below exp(-80) (held there, like the torch path)."""
    assert_matches_reference(make_inputs(2, 300, 2, 16, 32, seed=int(decay), decay=decay), torch.randn(2, 2, 16, 32))


def test_mixed_channel_decays():
    """A few fast-decaying channels force direct steps while the others would stay lazy for long."""
    q, k, v, g, beta = make_inputs(1, 400, 2, 32, 32, seed=12, decay=0.02)
    g[..., :3] = -torch.rand(1, 400, 2, 3) * 8.0
    assert_matches_reference((q, k, v, g, beta), torch.randn(1, 2, 32, 32))


def test_large_work_runs_threaded_and_agrees():
    """Above the kernel's threading threshold: jobs spread over the threads."""
    assert_matches_reference(make_inputs(1, 256, 4, 64, 64, seed=13, decay=0.1), tol=2e-4)


def test_non_contiguous_inputs():
    q, k, v, g, beta = make_inputs(2, 60, 3, 16, 16, seed=14)
    views = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, g, beta)]
    assert not any(x.is_contiguous() for x in views)
    assert_matches_reference(views)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(dtype, calls):
    inputs = make_inputs(2, 70, 2, 16, 16, seed=15, dtype=dtype)
    o, _ = OP(*inputs)
    assert o.dtype == dtype and calls == [True]
    assert_matches_reference(inputs, tol=1e-2)


def test_switched_off_uses_torch(monkeypatch, calls):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert_matches_reference(make_inputs(1, 30, 2, 8, 8, seed=16))
    assert calls == [False]


def test_callers_state_is_not_changed():
    inputs = make_inputs(1, 30, 2, 8, 8, seed=17)
    s0 = torch.randn(1, 2, 8, 8)
    before = s0.clone()
    OP(*inputs, initial_state=s0, output_final_state=True)
    assert torch.equal(s0, before)


@pytest.mark.parametrize(("t", "dk", "dv"), [(0, 8, 4), (5, 8, 0)])
def test_empty_sizes(t, dk, dv):
    """No steps or no values: empty outputs, the initial state handed back unchanged."""
    inputs = make_inputs(1, t, 2, dk, dv, seed=18)
    s0 = torch.randn(1, 2, dk, dv)
    o, s = OP(*inputs, initial_state=s0, output_final_state=True)
    ro, rs = reference_chunk_kda(*inputs, initial_state=s0, output_final_state=True)
    assert o.shape == (1, t, 2, dv) and torch.equal(o, ro)
    torch.testing.assert_close(s, rs)


@pytest.mark.parametrize("dk", [16, 5])
def test_the_kernels_decay_pass(dk, calls):
    """The kernel takes the log decay as the op does: exp(max(g, -80)) in one pass over blocks handed to the
    threads (here 1100 steps: more than 16 blocks), a tail shorter than a vector (dk=5), g = -inf a reset, and a
    positive g anywhere refused with its position, before any output or the caller's state is touched."""
    q, k, v, g, beta = make_inputs(1, 1100, 4, dk, 8, seed=dk, decay=3.0)
    g[0, 500, 2] = float("-inf")
    s0 = torch.randn(1, 4, dk, 8)
    assert_matches_reference((q, k, v, g, beta), s0)
    kept = s0.clone()
    g[0, -1, -1, -1] = 0.5
    with pytest.raises(ValueError, match=rf"must be <= 0 .* g\[0, 1099, 3, {dk - 1}\] = 0.5"):
        OP(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert torch.equal(s0, kept) and all(calls)

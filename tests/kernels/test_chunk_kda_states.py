"""ascend_dsa::chunk_kda_states: the per-step states (speculative decoding's checkpoints) through the native
recurrence and the torch step loop: each checkpoint is bitwise the final state of a run over that prefix, close to
the readable reference recurrence, and the outputs are chunk_kda's; errors name the bad argument."""
import pytest
import torch
from native_paths import native_and_torch
from test_chunk_kda import make_inputs

from npu_graph.kernels.kda import native as chunk_kda_native
from npu_graph.kernels.kda.chunk_kda import reference_chunk_kda

OPS = torch.ops.ascend_dsa


path = native_and_torch(chunk_kda_native.NATIVE_SOURCE)   # the native recurrence at each level, and torch's


@pytest.mark.parametrize(("b", "t", "h", "dk", "dv", "n"), [
    (2, 5, 2, 16, 24, 5), (1, 12, 3, 32, 130, 6), (3, 9, 2, 8, 8, 3), (1, 4, 1, 5, 17, 0)])
@pytest.mark.parametrize("decay", [0.2, 60.0], ids=["lazy", "direct"])
def test_checkpoints_are_prefix_final_states(b, t, h, dk, dv, n, decay, path):
    inputs = make_inputs(b, t, h, dk, dv, seed=t + n, decay=decay)
    s0 = torch.randn(b, h, dk, dv)
    o, final, states = OPS.chunk_kda_states(*inputs, initial_state=s0, num_states=n)
    assert states.shape == (b, n, h, dk, dv) and states.dtype == torch.float32
    ro, rs = reference_chunk_kda(*inputs, initial_state=s0, output_final_state=True)
    torch.testing.assert_close(o, ro, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, rs, rtol=1e-4, atol=1e-4)
    for j in range(n):
        prefix = tuple(x[:, :j + 1] for x in inputs)
        _, alone, _ = OPS.chunk_kda_states(*prefix, initial_state=s0, num_states=0)
        assert torch.equal(states[:, j], alone), f"checkpoint {j} differs from the run over {j + 1} steps"
        _, ref = reference_chunk_kda(*prefix, initial_state=s0, output_final_state=True)
        torch.testing.assert_close(states[:, j], ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(s0, s0.clone())


def test_outputs_equal_chunk_kda_and_keep_the_callers_state(path):
    inputs = make_inputs(2, 6, 2, 16, 16, seed=4)
    s0 = torch.randn(2, 2, 16, 16)
    kept = s0.clone()
    o, final, states = OPS.chunk_kda_states(*inputs, initial_state=s0, num_states=6)
    ro, rfinal = OPS.chunk_kda(*inputs, initial_state=s0, output_final_state=True)
    assert torch.equal(o, ro) and torch.equal(final, rfinal) and torch.equal(states[:, -1], final)
    assert torch.equal(s0, kept)


def test_native_writes_a_callers_buffer():
    """The native entry point writes checkpoints straight into a caller-provided buffer (one pass)."""
    fn = chunk_kda_native.kernel()
    if fn is None:
        pytest.skip("native kernel not available")
    q, k, v, g, beta = make_inputs(1, 7, 2, 8, 12, seed=9)
    slots = torch.full((1, 4, 2, 8, 12), float("nan"))
    chunk_kda_native.recurrence(fn, q, k, v, g, beta, 8 ** -0.5, None, slots)
    _, rs = reference_chunk_kda(q[:, :4], k[:, :4], v[:, :4], g[:, :4], beta[:, :4], output_final_state=True)
    torch.testing.assert_close(slots[:, 3], rs, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="checkpoint buffer"):
        chunk_kda_native.recurrence(fn, q, k, v, g, beta, 1.0, None, torch.empty(1, 8, 2, 8, 12))


@pytest.mark.parametrize("n", [-1, 8])
def test_bad_num_states(n):
    with pytest.raises(ValueError, match="num_states"):
        OPS.chunk_kda_states(*make_inputs(1, 7, 1, 4, 4), num_states=n)


def test_fake_and_compiled():
    inputs = make_inputs(2, 5, 2, 8, 8, seed=2)
    s0 = torch.randn(2, 2, 8, 8)

    def f(q, k, v, g, beta, s):
        return OPS.chunk_kda_states(q, k, v, g, beta, None, s, num_states=3)

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    for got, want in zip(compiled(*inputs, s0), f(*inputs, s0)):
        assert torch.equal(got, want)

"""ascend_dsa::chunk_kda is differentiable: its gradients (recomputed with kernels/kda/grad.py's
out-of-place chunked form) match autograd through the readable step reference."""
import pytest
import torch

import npu_graph.kernels  # noqa: F401  (registers the ops)
from npu_graph.kernels.kda.chunk_kda import reference_chunk_kda
from npu_graph.kernels.kda.grad import _unit_lower_solve, differentiable_chunk_kda


def _inputs(b, t, h, dk, dv, strong_decay=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -torch.rand(b, t, h, dk, generator=gen) * (40.0 if strong_decay else 2.0)
    beta = torch.rand(b, t, h, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta, state)]


def _grads(fn, leaves):
    o, final = fn(*leaves)
    (o.sin().sum() + final.cos().sum()).backward()
    return o.detach(), final.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("t,strong", [(1, False), (33, False), (70, True)])
def test_op_gradients_match_the_reference(t, strong):
    ours = _inputs(2, t, 2, 8, 6, strong)
    ref = [x.detach().clone().requires_grad_() for x in ours]
    o, _, grads = _grads(lambda *a: torch.ops.ascend_dsa.chunk_kda(*a[:5], 0.3, a[5], output_final_state=True),
                             ours)
    o_ref, _, grads_ref = _grads(lambda *a: reference_chunk_kda(
        *a[:5], scale=0.3, initial_state=a[5], output_final_state=True), ref)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    for name, got, want in zip(["q", "k", "v", "g", "beta", "state"], grads, grads_ref):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"gradient of {name}")


def test_gradients_without_state_or_final_output():
    q, k, v, g, beta, _ = _inputs(1, 40, 2, 4, 4)
    o, final = torch.ops.ascend_dsa.chunk_kda(q, k, v, g, beta)
    assert final.numel() == 0
    o.square().sum().backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in (q, k, v, g, beta))


def test_differentiable_form_is_the_recurrence():
    q, k, v, g, beta, state = (x.detach() for x in _inputs(2, 100, 3, 8, 5, strong_decay=True))
    o, final = differentiable_chunk_kda(q, k, v, g, beta, 0.5, state)
    o_ref, final_ref = reference_chunk_kda(q, k, v, g, beta, scale=0.5, initial_state=state,
                                           output_final_state=True)
    torch.testing.assert_close(o, o_ref, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(final, final_ref, atol=5e-5, rtol=1e-4)


def test_unit_lower_solve_is_a_triangular_solve():
    lower = torch.randn(3, 32, 32).tril(-1) * 0.3
    rhs = torch.randn(3, 32, 5)
    want = torch.linalg.solve_triangular(torch.eye(32) + lower, rhs, upper=False, unitriangular=True)
    torch.testing.assert_close(_unit_lower_solve(lower, rhs), want, atol=1e-4, rtol=1e-4)

"""vllm_ops: vLLM's RMSNorm, residual add + RMSNorm and SiLU-and-mul ops (registered with vLLM's schemas by the
reinplace_functionalized tests) become their math, which the fusions turn into ascend_dsa's fused ops, with the
ops' own results; a call the pass does not know stays as it is."""
import pytest
import torch
from test_reinplace_functionalized import ops

import npu_graph
from npu_graph.passes import vllm_ops

SERVING_OPS = {"serving_ops::rms_norm": vllm_ops.KNOWN["_C::rms_norm"],
               "serving_ops::fused_add_rms_norm": vllm_ops.KNOWN["_C::fused_add_rms_norm"],
               "serving_ops::silu_and_mul": vllm_ops.KNOWN["_C::silu_and_mul"]}


@pytest.fixture
def known(monkeypatch):
    monkeypatch.setattr(vllm_ops, "KNOWN", SERVING_OPS)


def block(x, residual, w):
    """vLLM's serving path of a decoder layer's norms and activation, as its CPU ops spell it."""
    normed = torch.empty_like(x)
    ops.fused_add_rms_norm(x, residual, w, 1e-6)
    ops.rms_norm(normed, x, w, 1e-5)
    act = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype)
    ops.silu_and_mul(act, normed)
    return act, residual


def _compiled(fn, inputs, dynamic=False):
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False, "strict": True}))
    eager = [t.clone() for t in inputs]
    with torch.no_grad():
        expected = fn(*eager)
        got = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*inputs)
    return backend.reports[-1], expected, got, eager


def _inputs(tokens=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(tokens, 64, generator=g).to(dtype), torch.randn(tokens, 64, generator=g).to(dtype),
            torch.randn(64, generator=g).to(dtype)]


@pytest.mark.parametrize("dynamic", [False, True])
def test_vllm_norms_become_the_fused_ops_with_the_ops_results(known, dynamic):
    inputs = _inputs()
    report, expected, got, eager = _compiled(block, inputs, dynamic)
    torch.testing.assert_close(got, expected)
    for a, b in zip(inputs, eager):      # the caller's x and residual are written as the ops write them
        torch.testing.assert_close(a, b)
    stats = next(p["stats"] for p in report.passes if p["name"] == vllm_ops.NAME)
    assert stats["expanded"] == {"rms_norm": 1, "fused_add_rms_norm": 1, "silu_and_mul": 1}
    assert report.fused_ops == {"add_rms_norm": 1, "rms_norm": 1}


def test_bf16_norms_agree_with_the_ops_to_bf16_rounding(known):
    inputs = _inputs(dtype=torch.bfloat16)
    _, expected, got, _ = _compiled(block, inputs)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_an_op_of_another_schema_or_a_written_view_is_left_alone(known, monkeypatch):
    def writes_a_view(x, w):
        out = torch.empty(x.shape[0], 2 * x.shape[1])
        ops.rms_norm(out[:, :x.shape[1]], x, w, 1e-6)
        return out[:, :x.shape[1]]

    x, w = torch.randn(3, 16), torch.randn(16)
    report, expected, got, _ = _compiled(writes_a_view, [x, w])
    torch.testing.assert_close(got, expected)
    assert next(p for p in report.passes if p["name"] == vllm_ops.NAME)["changed"] is False
    monkeypatch.setitem(vllm_ops.KNOWN, "serving_ops::rms_norm", ("rms_norm", 5, (0,)))    # another arity
    report, expected, got, _ = _compiled(block, _inputs())
    torch.testing.assert_close(got, expected)
    assert next(p["stats"] for p in report.passes if p["name"] == vllm_ops.NAME)["expanded"] == {
        "fused_add_rms_norm": 1, "silu_and_mul": 1}

"""The CPU runtime calls fused ops' implementations directly (no dispatcher), with identical results."""
import pytest
import torch

import npu_graph
from npu_graph.direct_calls import ATEN_PREFIX, PREFIX, bind_aten_calls, bind_direct_calls, implementation


def test_fused_op_calls_are_bound_to_their_implementation():
    source = ("def forward(self, x, g):\n"
              "    y = torch.ops.ascend_dsa.rms_norm.default(x, g, 1e-06)\n"
              "    return (torch.ops.aten.add.Tensor(y[0], 1), torch.ops.ascend_dsa.no_such_op.default(x))\n")
    runnable, functions = bind_direct_calls(source)
    assert f"{PREFIX}rms_norm(x, g, 1e-06)" in runnable
    assert "torch.ops.aten.add.Tensor" in runnable and "torch.ops.ascend_dsa.no_such_op.default(x)" in runnable
    assert functions == {f"{PREFIX}rms_norm": implementation("rms_norm")}


def test_aten_calls_are_bound_to_their_overloads():
    source = ("def forward(self, x):\n    y = torch.ops.aten.add.Tensor(x, 1)\n"
              "    z = torch.ops.aten.add.Tensor(y, x)\n    return torch.ops.aten.view.default(z, [-1])\n")
    runnable, functions = bind_aten_calls(source)
    assert "torch.ops" not in runnable and runnable.count(f"{ATEN_PREFIX}add_Tensor(") == 2
    assert functions == {f"{ATEN_PREFIX}add_Tensor": torch.ops.aten.add.Tensor._op,
                         f"{ATEN_PREFIX}view_default": torch.ops.aten.view.default._op}
    namespace = dict(functions)
    exec(runnable, namespace)
    x = torch.randn(2, 3)
    assert torch.equal(namespace["forward"](None, x), (x + 1 + x).view(-1))


def test_compiled_graph_runs_direct_calls_with_identical_results():
    gamma = torch.randn(64)

    def fn(x, y):
        h = x + y
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma

    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False}))
    x, y = torch.randn(3, 64), torch.randn(3, 64)
    with torch.no_grad():
        out = torch.compile(fn, backend=backend)(x, y)
        direct = torch.ops.ascend_dsa.add_rms_norm.default(x, y, gamma, 1e-6)
    assert backend.reports[-1].fused_ops == {"add_rms_norm": 1}
    assert torch.equal(out, direct[0])


def test_static_checks_are_skipped_only_inside_a_compiled_graph(monkeypatch):
    from npu_graph.kernels import checks
    from npu_graph.kernels import rms_norm as rms_module

    calls = []
    monkeypatch.setattr(rms_module, "_check", lambda *a: calls.append(a))
    x, gamma = torch.randn(2, 8), torch.rand(8)
    torch.ops.ascend_dsa.rms_norm(x, gamma)
    assert len(calls) == 1
    with checks.shapes_checked_at_trace():
        torch.ops.ascend_dsa.rms_norm(x, gamma)
        assert not checks.static_checks_needed()
    assert len(calls) == 1 and checks.static_checks_needed()


def test_data_checks_still_run_in_compiled_graphs():
    def route(x, w13, w2, weights, ids):
        return torch.ops.ascend_dsa.fused_moe(x, w13, w2, weights, ids)

    args = (torch.randn(2, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 3), torch.rand(2, 1),
            torch.tensor([[0], [1]], dtype=torch.int32))
    compiled = torch.compile(route, backend=npu_graph.get_backend({"cache": False, "strict": True}))
    compiled(*args)
    with pytest.raises(ValueError, match="topk_ids"):
        compiled(*args[:4], torch.tensor([[0], [9]], dtype=torch.int32))

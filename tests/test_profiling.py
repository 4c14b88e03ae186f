"""Fused ops of a compiled graph appear in torch.profiler traces, named as the dispatcher names them, with the
implementation that ran; with no profiler the graph calls the plain functions."""
import torch
from torch.profiler import ProfilerActivity, profile

from npu_graph.runtime.profiling import ProfiledCalls


class NormBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(64) + 0.5)
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.lin(x)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


def _event_names(fn, *args):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args)
    return {e.name for e in prof.events()}


def test_compiled_fused_op_and_its_implementation_are_profiler_events(monkeypatch):
    monkeypatch.setenv("ASCEND_DSA_NATIVE", "1")
    model, x = NormBlock().eval(), torch.randn(2, 64)
    compiled = torch.compile(model, backend="ascend_dsa", options={"cache": False})
    with torch.no_grad():
        compiled(x)
        names = _event_names(compiled, x)
        torch.testing.assert_close(compiled(x), model(x))
    assert "ascend_dsa::rms_norm" in names
    assert any(n.startswith("ascend_dsa::rms_norm/native[") for n in names), sorted(names)


def test_torch_path_is_named_when_native_kernels_are_off(monkeypatch):
    monkeypatch.setenv("ASCEND_DSA_NATIVE", "0")
    compiled = torch.compile(NormBlock().eval(), backend="ascend_dsa", options={"cache": False})
    with torch.no_grad():
        compiled(torch.randn(2, 64))
        names = _event_names(compiled, torch.randn(2, 64))
    assert "ascend_dsa::rms_norm" in names
    assert not any("/native[" in n for n in names)


def test_namespace_holds_plain_functions_when_no_profiler_runs():
    def op(x):
        return x + 1

    namespace = {"f": op}
    calls = ProfiledCalls(namespace, {"f": "ascend_dsa::f"})
    calls.sync()
    assert namespace["f"] is op
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        calls.sync()
        assert namespace["f"] is not op and namespace["f"](1) == 2
    assert "ascend_dsa::f" in {e.name for e in prof.events()}
    calls.sync()
    assert namespace["f"] is op

"""Parameter-only work runs once per parameter version (the prologue), and results always match eager."""
import torch

import npu_graph
from npu_graph import runtime


class Stacked(torch.nn.Module):
    """Stacks and casts its weights on every call, as fused MoE graphs do."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        w = torch.stack([self.a, self.b]).double().sum(0).float()
        return x @ w.t()


def compile_model(tmp_path=None):
    options = {"cache": tmp_path is not None}
    if tmp_path is not None:
        options["cache_dir"] = str(tmp_path)
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options(options))
    torch.manual_seed(0)
    model = Stacked()
    return model, torch.compile(model, backend=backend), backend


def test_prologue_runs_once_per_parameter_version(monkeypatch):
    model, compiled, _ = compile_model()
    calls = []
    original = runtime.CompiledGraph._hoisted_values

    def counting(self, inputs):
        before = self._hoisted_for
        result = original(self, inputs)
        calls.append(before != self._hoisted_for)
        return result

    monkeypatch.setattr(runtime.CompiledGraph, "_hoisted_values", counting)
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), model(x))
        model.a.mul_(2.0)
        torch.testing.assert_close(compiled(x), model(x))
    assert calls == [True, False, False, True]


def test_prologue_survives_the_disk_cache(tmp_path):
    x = torch.randn(3, 8)
    with torch.no_grad():
        model, compiled, _ = compile_model(tmp_path)
        first = compiled(x)
        torch._dynamo.reset()
        model, compiled, backend = compile_model(tmp_path)
        second = compiled(x)
    assert backend.reports[-1].cache == "hit"
    torch.testing.assert_close(first, second)
    torch.testing.assert_close(second, model(x))

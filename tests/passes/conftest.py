"""Shared harness for pass tests: compile a function with one pass watched, and return eager and compiled
results, the graph report, the pass's stats and the graph's operators just before and after that pass."""
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import npu_graph


def op_counts(gm: torch.fx.GraphModule) -> Counter:
    """{str(target): count} of the graph's call_function nodes (e.g. "aten.mm.default")."""
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def op_names(gm: torch.fx.GraphModule) -> set[str]:
    """Operator names without overload ("aten.mul", "ascend_dsa.rms_norm")."""
    return {f"{n.target.namespace}.{n.target._opname}" for n in gm.graph.nodes
            if isinstance(n.target, torch._ops.OpOverload)}


@pytest.fixture
def watch_pass(monkeypatch):
    def watch(pass_module, fn, *args, options=None, dynamic=None):
        seen = []
        original = pass_module.run

        def spy(gm, ctx):
            before = (op_counts(gm), op_names(gm))
            result = original(gm, ctx)
            seen.append((before, (op_counts(gm), op_names(gm))))
            return result

        monkeypatch.setattr(pass_module, "run", spy)
        backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False,
                                                                                   **(options or {})}))
        with torch.no_grad():
            ref = fn(*args)
            out = torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
        report = backend.reports[-1]
        stats = next((p["stats"] for p in report.passes if p["name"] == pass_module.NAME), {})
        (before, before_names), (after, after_names) = seen[-1] if seen else ((Counter(), set()),) * 2
        return SimpleNamespace(ref=ref, out=out, report=report, stats=stats, before=before, after=after,
                               before_names=before_names, after_names=after_names)

    return watch

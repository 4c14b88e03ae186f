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


def _merged_stats(report, names: list[str]) -> dict:
    """The stats of each named pass's first run in the report; of several passes, their matches and near misses
    together."""
    found = [next((p["stats"] for p in report.passes if p["name"] == name), {}) for name in names]
    if len(found) == 1:
        return found[0]
    matches: Counter = Counter()
    for stats in found:
        matches.update(stats.get("matches", {}))
    return {"matches": dict(matches), "near_misses": [m for stats in found for m in stats.get("near_misses", [])]}


@pytest.fixture
def watch_pass(monkeypatch):
    """watch(pass_module or a tuple of consecutive pass modules, fn, *args): `before` is the graph before the
    first of them ran, `after` the graph after the last; the stats of several passes are merged."""
    def watch(pass_modules, fn, *args, options=None, dynamic=None):
        modules = pass_modules if isinstance(pass_modules, tuple) else (pass_modules,)
        seen: list[list] = [[] for _ in modules]
        for i, module in enumerate(modules):
            def spy(gm, ctx, original=module.run, calls=seen[i]):
                calls.append((op_counts(gm), op_names(gm)))
                result = original(gm, ctx)
                calls.append((op_counts(gm), op_names(gm)))
                return result

            monkeypatch.setattr(module, "run", spy)
        backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False,
                                                                                   **(options or {})}))
        with torch.no_grad():
            ref = fn(*args)
            out = torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
        report = backend.reports[-1]
        stats = _merged_stats(report, [m.NAME for m in modules])
        empty = (Counter(), set())
        before, before_names = seen[0][-2] if seen[0] else empty
        after, after_names = seen[-1][-1] if seen[-1] else empty
        return SimpleNamespace(ref=ref, out=out, report=report, stats=stats, before=before, after=after,
                               before_names=before_names, after_names=after_names)

    return watch

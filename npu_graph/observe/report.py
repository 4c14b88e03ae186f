"""GraphReport: what the compiler did to one graph; the source of summary.json and the demo tables."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

FUSED_NAMESPACE = "ascend_dsa"
PASS_SECTIONS = ("quantized", "layouts", "streams", "superkernels", "npu_program", "implementations", "runtime",
                 "expert_parallel")


def graph_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The graph's nodes and those of its submodules' graphs (SuperKernel regions)."""
    return [n for module in gm.modules() if isinstance(module, torch.fx.GraphModule) for n in module.graph.nodes]


def fused_op_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    """{op name: count} of the `torch.ops.ascend_dsa.*` calls in a graph."""
    counts: Counter[str] = Counter()
    for node in graph_nodes(gm):
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target.namespace == FUSED_NAMESPACE:
            counts[target._opname] += 1
    return dict(sorted(counts.items()))


def op_count(gm: torch.fx.GraphModule) -> int:
    """Operators the graph dispatches per call (ATen and fused ops; size queries and tuple access excluded)."""
    return sum(1 for n in graph_nodes(gm) if isinstance(n.target, torch._ops.OpOverload)
               and n.target.namespace in ("aten", FUSED_NAMESPACE) and not n.target._opname.startswith("sym_"))


@dataclass
class GraphReport:
    name: str
    inference: bool
    target: str
    nodes_before: int = 0
    nodes_after: int = 0
    ops: int = 0
    fused_ops: dict[str, int] = field(default_factory=dict)
    passes: list[dict[str, Any]] = field(default_factory=list)
    cache: str = "bypass"
    cache_reason: str = ""
    timings_ms: dict[str, float] = field(default_factory=dict)
    dump_folder: str | None = None
    fallback: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # sections passes own (PASS_SECTIONS)

    @classmethod
    def from_summary(cls, name: str, summary: dict[str, Any], cache: str) -> GraphReport:
        """The report of a graph loaded from the cache, from the summary stored with it."""
        return cls(name=name, inference=summary.get("inference", True), target=summary.get("target", "cpu"),
                   nodes_before=summary.get("nodes_before", 0), nodes_after=summary.get("nodes_after", 0),
                   ops=summary.get("ops", 0),
                   fused_ops=summary.get("fused_ops", {}), passes=summary.get("passes", []), cache=cache,
                   extra={k: summary[k] for k in PASS_SECTIONS if k in summary})

    def near_misses(self) -> list[dict[str, Any]]:
        """Every pass's near misses (a candidate that almost matched, with the reason), tagged with the pass."""
        return [{"pass": p["name"], **miss} for p in self.passes for miss in p.get("stats", {}).get("near_misses", [])]

    def to_json(self) -> dict[str, Any]:
        return {
            "graph": self.name, "inference": self.inference, "target": self.target,
            "nodes_before": self.nodes_before, "nodes_after": self.nodes_after, "ops": self.ops,
            "fused_ops": self.fused_ops, "near_misses": self.near_misses(), "passes": self.passes,
            "cache": self.cache, "cache_reason": self.cache_reason,
            "timings_ms": {k: round(v, 3) for k, v in self.timings_ms.items()},
            "fallback": self.fallback, **self.extra,
        }


def glue_summary(reports: list[GraphReport]) -> str:
    """What ran each CPU graph's glue, in compile order (summary.json's runtime.glue): "inductor,python,..."."""
    return ",".join(r.extra.get("runtime", {}).get("glue", "?") for r in reports)

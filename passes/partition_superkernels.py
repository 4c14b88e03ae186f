"""partition_superkernels: group maximal runs of plain ATen ops into one launchable region each.

What vllm-ascend marks by hand with torchair `super_kernel` scopes is derived here: walking the graph in
order, consecutive pure ATen compute nodes on the same stream form a region; a fused `ascend_dsa` op, an
in-place write, a stream event or a change of stream ends it. Regions with at least two operators become a
call_module node over a submodule `superkernel_N` (npu_graph.runtime.superkernel; node.meta["superkernel"] = N on
the call and on the nodes inside). The CPU target compiles each region as one callable (plain Python, or
Inductor with `superkernel.compiler="inductor"`, or the faster of both, timed at the first call, with
"measured", the max-autotune modes' choice); the NPU target opens a `super_kernel` scope per region.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from npu_graph.pass_api import MetaKey, PassContext, PassResult
from npu_graph.passes.streams.cost_model import is_free
from npu_graph.runtime.superkernel import PREFIX, is_region, wrap

NAME = "partition_superkernels"
INFERENCE_ONLY = True
MIN_OPS = 2


def eligible(node: torch.fx.Node, open_region: set[torch.fx.Node]) -> bool:
    """A pure ATen op with tensor results, or an item of a tuple the open region computes."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return node.args[0] in open_region
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten" or node.is_impure():
        return False
    value = node.meta.get("val")
    values = value if isinstance(value, (tuple, list)) else [value]
    return bool(values) and all(isinstance(v, torch.Tensor) for v in values)


def _runs(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    runs: list[list[torch.fx.Node]] = [[]]
    open_region: set[torch.fx.Node] = set()
    for node in graph.nodes:
        same_stream = not runs[-1] or node.meta.get(MetaKey.STREAM, 0) == runs[-1][0].meta.get(MetaKey.STREAM, 0)
        if not (eligible(node, open_region) and same_stream):
            runs.append([])
            open_region = set()
            if not eligible(node, open_region):
                continue
        runs[-1].append(node)
        open_region.add(node)
    return [run for run in runs if sum(not is_free(n) for n in run) >= MIN_OPS]


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    config = ctx.config.superkernel
    if not config.enabled or any(is_region(n) for n in gm.graph.nodes):
        return PassResult(changed=False, summary={"superkernels": {"count": 0, "enabled": config.enabled}})
    runs = _runs(gm.graph)
    for index, members in enumerate(runs):
        for node in members:
            node.meta[MetaKey.SUPERKERNEL] = index
    regions = [{"name": f"{PREFIX}{i}", "stream": members[0].meta.get(MetaKey.STREAM, 0),
                "ops": sum(not is_free(n) for n in members), "nodes": len(members)}
               for i, members in enumerate(runs)]
    wrap(gm)
    compiler = ctx.config.superkernel_compiler()
    gm.meta[MetaKey.SUPERKERNEL_COMPILER] = compiler
    inside = sum(r["ops"] for r in regions)
    summary = {"count": len(regions), "enabled": True, "compiler": compiler, "ops_inside": inside,
               "regions": regions}
    return PassResult(changed=bool(regions), stats={"regions": len(regions), "ops_inside": inside},
                      summary={"superkernels": summary})

"""CPU lowering: turn the final graph into a CompiledGraph (generated source + constant plan).

Fused `ascend_dsa` ops run their CPU implementations through torch.ops; everything else runs as ATen.
"""
from __future__ import annotations

import torch.fx

from npu_graph.runtime import CompiledGraph


def attribute_plan(gm: torch.fx.GraphModule) -> dict[str, object]:
    """Every constant or submodule the graph reads with get_attr / call_module, by its dotted path."""
    plan: dict[str, object] = {}
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            owner: object = gm
            for part in node.target.split("."):
                owner = getattr(owner, part)
            plan[node.target] = owner
    return plan


def lower(gm: torch.fx.GraphModule, name: str) -> CompiledGraph:
    code = gm.graph.python_code(root_module="self")
    return CompiledGraph(name, code.src, code.globals, attribute_plan(gm))

"""CPU lowering: turn the final graph into a CompiledGraph (generated source + constant plan).

Fused `ascend_dsa` ops run their CPU implementations, everything else runs as ATen (or a native kernel that
takes the call), each call bound by the source's own header (npu_graph.targets.cpu_bindings).
"""
from __future__ import annotations

import torch.fx

from npu_graph.pass_api import MetaKey
from npu_graph.runtime import streams, superkernel
from npu_graph.runtime.compiled_graph import CompiledGraph
from npu_graph.runtime.hoist import split_prologue
from npu_graph.targets.cpu_bindings import bind_source


def attribute_plan(gm: torch.fx.GraphModule) -> dict[str, object]:
    """Every constant or submodule the graph reads with get_attr / call_module, by its dotted path
    (superkernel regions are functions of the generated source instead)."""
    plan: dict[str, object] = {}
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module") and not superkernel.is_region(node):
            owner: object = gm
            for part in node.target.split("."):
                owner = getattr(owner, part)
            plan[node.target] = owner
    return plan


def lower(gm: torch.fx.GraphModule, name: str, param_indices: tuple[int, ...] = (),
          frozen_parameters: bool = False) -> CompiledGraph:
    """Generated source for the graph; with `param_indices`, parameter-only work goes into a `prologue`
    function that the runtime runs once per parameter version (npu_graph.runtime.hoist), or once and never checks
    again with `frozen_parameters` (FROZEN_PARAMETERS in the source: torchair's frozen_parameter).
    SuperKernel regions are opened for hoisting and closed again, then each becomes a function `superkernel_N`
    of the source.
    Stream events of a graph that runs wholly on the CPU are dropped (they are no-ops there)."""
    streams.drop_host_events(gm)
    prologue, used = None, []
    if param_indices:
        superkernel.inline(gm)
        prologue, used = split_prologue(gm, list(param_indices))
        superkernel.wrap(gm)
    code = gm.graph.python_code(root_module="self")
    regions, region_globals = superkernel.region_source(gm)
    source, globals_, attributes = regions + code.src, {**region_globals, **code.globals}, attribute_plan(gm)
    if prologue is not None:
        pro = prologue.graph.python_code(root_module="self")
        source = pro.src.replace("def forward(", "def prologue(", 1) + source
        globals_.update(pro.globals)
        attributes.update(attribute_plan(prologue))
    # Settings go at the top: each generated function's source ends inside its indented body.
    if regions:
        source = f"SUPERKERNEL_COMPILER = {gm.meta.get(MetaKey.SUPERKERNEL_COMPILER, 'python')!r}\n" + source
    if prologue is not None and frozen_parameters:
        source = "FROZEN_PARAMETERS = True\n" + source
    return CompiledGraph(name, bind_source(source), globals_, attributes, tuple(used))

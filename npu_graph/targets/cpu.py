"""CPU lowering: turn the final graph into a CompiledGraph (generated source + constant plan).

Fused `ascend_dsa` ops run their CPU implementations, everything else runs as ATen (or a native kernel that
takes the call), each call bound by the source's own header (npu_graph.targets.cpu_bindings).
"""
from __future__ import annotations

import torch.fx

from npu_graph.pass_api import MetaKey
from npu_graph.runtime import inductor_glue, streams, superkernel
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


def _graph_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of gm's graph (nodes' meta shared) that Inductor's own passes may rewrite."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def _inductor_source(gm: torch.fx.GraphModule, glue: str) -> tuple[str | None, str]:
    """Inductor's module source for the glue of gm (after hoisting) when `glue` asks for it ("inductor") or
    "auto" finds it worth it, else None; and why (npu_graph.runtime.inductor_glue)."""
    if glue == "python":
        return None, "option cpu.glue='python'"
    if glue == "auto":
        worth, reason = inductor_glue.worth_compiling(gm)
        if not worth:
            return None, reason
    else:
        reason = "option cpu.glue='inductor'"
    try:
        return inductor_glue.compile_forward(_graph_copy(gm)), reason
    except Exception as exc:        # "auto" keeps the Python form, which runs any graph; the reason is reported
        if glue == "inductor":
            raise
        return None, f"Inductor could not take the graph ({type(exc).__name__}: {exc})"


def _python_source(gm: torch.fx.GraphModule, rewrap: bool) -> tuple[str, dict, dict]:
    """The graph as generated Python: one call per node, each SuperKernel region a function `superkernel_N`."""
    if rewrap:
        superkernel.wrap(gm)
    code = gm.graph.python_code(root_module="self")
    regions, region_globals = superkernel.region_source(gm)
    source = regions + code.src
    # Settings go at the top: each generated function's source ends inside its indented body.
    if regions:
        source = f"SUPERKERNEL_COMPILER = {gm.meta.get(MetaKey.SUPERKERNEL_COMPILER, 'python')!r}\n" + source
    return source, {**region_globals, **code.globals}, attribute_plan(gm)


def lower(gm: torch.fx.GraphModule, name: str, param_indices: tuple[int, ...] = (),
          frozen_parameters: bool = False, glue: str = "python") -> CompiledGraph:
    """Generated source for the graph; with `param_indices`, parameter-only work goes into a `prologue`
    function that the runtime runs once per parameter version (npu_graph.runtime.hoist), or once and never checks
    again with `frozen_parameters` (FROZEN_PARAMETERS in the source: torchair's frozen_parameter).
    `glue` ("python", "inductor" or "auto") says what runs the graph after hoisting: Python, one call per node,
    with SuperKernel regions as functions `superkernel_N`; or Inductor's generated module
    (npu_graph.runtime.inductor_glue; GLUE = 'inductor' at the top of the source), regions not formed. The
    CompiledGraph's `glue` says which, its `glue_reason` why.
    Stream events of a graph that runs wholly on the CPU are dropped (they are no-ops there)."""
    streams.drop_host_events(gm)
    prologue, used = None, []
    opened = bool(param_indices) or glue != "python"     # regions put back inline (for hoisting or for Inductor)
    if opened:
        superkernel.inline(gm)
    if param_indices:
        prologue, used = split_prologue(gm, list(param_indices))
    source, reason = _inductor_source(gm, glue)
    by_inductor = source is not None
    if by_inductor:
        globals_, attributes = {}, {}
    else:
        source, globals_, attributes = _python_source(gm, rewrap=opened)
    if prologue is not None:
        pro = prologue.graph.python_code(root_module="self")
        source = pro.src.replace("def forward(", "def prologue(", 1) + "\n" + source
        globals_.update(pro.globals)
        attributes.update(attribute_plan(prologue))
    if prologue is not None and frozen_parameters:
        source = "FROZEN_PARAMETERS = True\n" + source
    if by_inductor:
        source = "GLUE = 'inductor'\n" + source
    compiled = CompiledGraph(name, bind_source(source), globals_, attributes, tuple(used))
    compiled.glue_reason = reason
    return compiled

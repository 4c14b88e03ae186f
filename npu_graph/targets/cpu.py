"""CPU lowering: turn the final graph into a CompiledGraph (generated source + constant plan).

Fused `ascend_dsa` ops run their CPU implementations, everything else runs as ATen (or a native kernel that
takes the call), each call bound by the source's own header (npu_graph.targets.cpu_bindings).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx

from npu_graph.pass_api import MetaKey
from npu_graph.runtime import glue_upgrade, inductor_glue, streams, superkernel, view_chains
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


def _glue_choice(gm: torch.fx.GraphModule, glue: str) -> tuple[str, str]:
    """What runs the glue of gm (after hoisting): "python", "inductor" (compiled now; "now" under "auto", where
    a failed compile leaves the Python form) or "background" (the Python form first, Inductor's compiled on a
    background thread: npu_graph.runtime.glue_upgrade); and why. Under "auto" a graph worth compiling whose sizes
    are symbolic and whose Python glue makes many calls (inductor_glue.compile_now) is compiled now: it is the
    graph every later step of a generate() loop runs, and the rounds right after a first call would otherwise run
    its Python form while its compile competes with them for the cores (option "background" sends it to the
    background too: the shortest first call)."""
    if glue == "python":
        return "python", "option cpu.glue='python'"
    if glue == "inductor":
        return "inductor", "option cpu.glue='inductor'"
    worth, reason = inductor_glue.worth_compiling(gm)
    if worth and glue == "auto" and inductor_glue.compile_now(gm):
        return "now", f"{reason}; symbolic sizes (the graph for every later size): compiled with the graph"
    return ("background" if worth else "python"), reason


def _python_source(gm: torch.fx.GraphModule, rewrap: bool) -> tuple[str, dict, dict]:
    """The graph as generated Python: one call per node, each SuperKernel region a function `superkernel_N`;
    chains of views are one call each (npu_graph.runtime.view_chains) where the regions run as Python (Dynamo,
    which compiles them under the other SuperKernel compilers, does not trace that call)."""
    if gm.meta.get(MetaKey.SUPERKERNEL_COMPILER, "python") == "python":
        if not rewrap:
            superkernel.inline(gm)
            rewrap = True
        view_chains.collapse(gm)
    if rewrap:
        superkernel.wrap(gm)
    code = gm.graph.python_code(root_module="self")
    regions, region_globals = superkernel.region_source(gm)
    source = regions + code.src
    # Settings go at the top: each generated function's source ends inside its indented body.
    if regions:
        source = f"SUPERKERNEL_COMPILER = {gm.meta.get(MetaKey.SUPERKERNEL_COMPILER, 'python')!r}\n" + source
    return source, {**region_globals, **code.globals}, attribute_plan(gm)


@dataclass
class _Prologue:
    """The hoisted parameter work of a graph (its source, globals and attributes) and how it is wrapped around
    the graph's glue; empty when nothing is hoisted."""
    source: str = ""
    globals_: dict = field(default_factory=dict)
    attributes: dict = field(default_factory=dict)
    frozen: bool = False

    @classmethod
    def of(cls, prologue: torch.fx.GraphModule | None, frozen_parameters: bool) -> _Prologue:
        if prologue is None:
            return cls()
        pro = prologue.graph.python_code(root_module="self")
        return cls(pro.src.replace("def forward(", "def prologue(", 1) + "\n", pro.globals,
                   attribute_plan(prologue), frozen_parameters)

    def around(self, glue: str, globals_: dict, attributes: dict, by_inductor: bool) -> glue_upgrade.Built:
        """The graph's bound source with this prologue and its settings, its globals and attributes."""
        source = self.source + glue
        if self.frozen:
            source = "FROZEN_PARAMETERS = True\n" + source
        if by_inductor:
            source = inductor_glue.GLUE_LINE + source
        return bind_source(source), {**globals_, **self.globals_}, {**attributes, **self.attributes}


def lower(gm: torch.fx.GraphModule, name: str, param_indices: tuple[int, ...] = (),
          frozen_parameters: bool = False, glue: str = "python") -> CompiledGraph:
    """Generated source for the graph; with `param_indices`, parameter-only work goes into a `prologue`
    function that the runtime runs once per parameter version (npu_graph.runtime.hoist), or once and never checks
    again with `frozen_parameters` (FROZEN_PARAMETERS in the source: torchair's frozen_parameter).
    `glue` ("python", "inductor", "auto" or "background") says what runs the graph after hoisting: Python, one call
    per node, with SuperKernel regions as functions `superkernel_N`; or Inductor's generated module
    (npu_graph.runtime.inductor_glue; GLUE = 'inductor' at the top of the source), regions not formed. "auto" gives
    a graph worth it Inductor's glue: now when its sizes are symbolic and its calls many (`_glue_choice`), else
    through a background compile (npu_graph.runtime.glue_upgrade), the graph running its Python form until that
    lands; "background" takes that path for symbolic graphs too. The CompiledGraph's `glue` says which runs, its
    `glue_reason` why. Stream events of a graph that runs wholly on the CPU are dropped (they are no-ops there)."""
    streams.drop_host_events(gm)
    prologue, used = None, []
    opened = bool(param_indices) or glue != "python"     # regions put back inline (for hoisting or for Inductor)
    if opened:
        superkernel.inline(gm)
    if param_indices:
        prologue, used = split_prologue(gm, list(param_indices))
    pro = _Prologue.of(prologue, frozen_parameters)
    choice, reason = _glue_choice(gm, glue)
    if choice != "python":
        inductor_glue.warm_vec_isa()
    if choice in ("inductor", "now"):
        try:
            compiled = CompiledGraph(name, *pro.around(inductor_glue.compile_forward(_graph_copy(gm)), {}, {}, True),
                                     tuple(used))
        except Exception as exc:
            if choice == "inductor":
                raise
            choice, reason = "python", f"{reason}; Inductor could not take it ({type(exc).__name__}: {exc})"
    if choice in ("python", "background"):
        copy = _graph_copy(gm) if choice == "background" else None    # before the Python form rewraps regions
        source, globals_, attributes = _python_source(gm, rewrap=opened)
        compiled = CompiledGraph(name, *pro.around(source, globals_, attributes, False), tuple(used))
        if copy is not None:
            compiled.attach_upgrade(glue_upgrade.GlueUpgrade(
                copy, lambda inductor_source: pro.around(inductor_source, {}, {}, True), reason))
    compiled.glue_reason = reason
    return compiled

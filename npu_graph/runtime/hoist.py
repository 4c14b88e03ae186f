"""Parameter prologue: work that depends only on model parameters runs once, not on every call.

Fusions restack expert weights, casts and transposes read only parameters; in an inference graph those
values change only when a parameter does. `split_prologue` moves every pure computation whose inputs are all
parameters or constants (deterministic factories such as `arange`, and what is computed from them) into a
separate `prologue` graph whose outputs become extra inputs of the main
graph. A prologue output that a batched product (bmm, baddbmm) reads as a strided view (a head slice of a
weight, a transposed one) is made contiguous there once: CPU bmm copies such an operand on every call (the
absorbed MLA weights of a DeepSeek-V3.2 layer: 34 MB copied per decode step, an eighth of its time). The
runtime (CompiledGraph) runs the prologue on the first call and again only when a parameter
object or its version counter changes (an in-place weight update), so results always match eager.
"""
from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten
# Deterministic factories with static arguments: their values (and what is computed from them alone, such as
# transformers' causal and packed-sequence masks built from aranges) are the same on every call.
CONSTANT_FACTORIES = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.ones.default,
                      aten.zeros.default, aten.full.default, aten.scalar_tensor.default}


def _reads_only(node: torch.fx.Node, found: set[torch.fx.Node]) -> bool:
    """A pure call whose tensor inputs are all hoistable, or a constant factory (no inputs at all)."""
    if node.op != "call_function" or node.is_impure():
        return False
    inputs = node.all_input_nodes
    return all(arg in found for arg in inputs) if inputs else node.target in CONSTANT_FACTORIES


def hoistable(gm: torch.fx.GraphModule, param_indices: set[int]) -> set[torch.fx.Node]:
    """Nodes computed from parameters and constants only; values the graph returns stay in it (the caller may
    modify a returned tensor, which must not change the next call's)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = {placeholders[i] for i in param_indices if i < len(placeholders)}
    returned = {arg for node in gm.graph.nodes if node.op == "output" for arg in node.all_input_nodes}
    for node in gm.graph.nodes:
        if node not in returned and (node.op == "get_attr" or _reads_only(node, found)):
            found.add(node)
    return found


def _frontier(hoistable: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """Hoistable tensor values that the rest of the graph reads (the prologue's outputs)."""
    frontier = []
    for node in hoistable:
        if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if any(user not in hoistable for user in node.users):
            frontier.append(node)
    order = {n: i for i, n in enumerate(next(iter(hoistable)).graph.nodes)} if hoistable else {}
    return sorted(frontier, key=order.__getitem__)


BATCHED_PRODUCTS = {aten.bmm.default, aten.baddbmm.default}


def read_as_strided_batch(node: torch.fx.Node, hoistable: set[torch.fx.Node]) -> bool:
    """Whether this non-contiguous prologue output is read by batched products only (which would copy it at every
    call). Nothing else may read it: the main graph's views of it were traced with its strides."""
    value = node.meta.get("val")
    readers = [user for user in node.users if user not in hoistable]
    return (isinstance(value, torch.Tensor) and value.dim() == 3 and not value.is_contiguous()
            and all(user.op == "call_function" and user.target in BATCHED_PRODUCTS for user in readers))


def _prologue_graph(gm: torch.fx.GraphModule, params: list[torch.fx.Node], hoistable: set[torch.fx.Node],
                    frontier: list[torch.fx.Node], made_contiguous: set[torch.fx.Node]) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for param in params:
        env[param] = graph.placeholder(param.name)
        env[param].meta = dict(param.meta)
    for node in gm.graph.nodes:
        if node in hoistable and node.op != "placeholder":
            env[node] = graph.node_copy(node, env.__getitem__)
    outputs = []
    for node in frontier:
        out = env[node]
        if node in made_contiguous:
            out = graph.call_function(aten.clone.default, (out,), {"memory_format": torch.contiguous_format})
            out.meta = {**node.meta, "val": node.meta["val"].contiguous()}
        outputs.append(out)
    graph.output(tuple(outputs))
    return torch.fx.GraphModule(gm, graph, "prologue")


def split_prologue(gm: torch.fx.GraphModule, param_indices: list[int]
                   ) -> tuple[torch.fx.GraphModule | None, list[int]]:
    """Move parameter-only computations out of `gm` (in place). Returns the prologue graph (None when there is
    nothing worth hoisting) and the input positions of the parameters it reads, in its argument order."""
    once = hoistable(gm, set(param_indices))
    frontier = _frontier(once)
    if not frontier:
        return None, []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    used = [i for i in sorted(param_indices) if i < len(placeholders) and placeholders[i] in once]
    made_contiguous = {node for node in frontier if read_as_strided_batch(node, once)}
    prologue = _prologue_graph(gm, [placeholders[i] for i in used], once, frontier, made_contiguous)
    with gm.graph.inserting_after(placeholders[-1]):
        for index, node in reversed(list(enumerate(frontier))):
            hoisted = gm.graph.placeholder(f"hoisted_{index}")
            hoisted.meta = dict(node.meta)
            if node in made_contiguous:
                hoisted.meta["val"] = node.meta["val"].contiguous()
            node.replace_all_uses_with(hoisted)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return prologue, used

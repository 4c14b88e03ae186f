"""Routed experts written densely (every expert on every token, as stacked weights and batched products), for
fuse_moe_experts. In canonical terms (passes/canonical/terms.py):

    out[t, h] = Σ_e D[t, e] · Σ_i act[e, t, i] · Wd[e, h, i],   act = silu(Σ_h x·Wg[e, i, h]) · Σ_h x·Wu[e, i, h]
    D = zeros(T, E).scatter(1, ids, w)  (or scatter_add)

with the products in any spelling (bmm of an expanded x, einsum, matmul with transposes, multiply + sum) and silu
spelled silu(g) or g · sigmoid(g). D holds each token's routing weights at its experts, so the sum over e is the
routed combine Σ_j w[t, j] · expert_{ids[t, j]}(x[t]) that fused_moe computes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from npu_graph.passes.canonical.reading import silu_of
from npu_graph.passes.canonical.structure import Structure
from npu_graph.passes.canonical.terms import Contraction, contraction
from npu_graph.passes.matching.axis_trace import Axis, Expr, Tracer, as_leaf, find, flat
from npu_graph.passes.matching.match_util import NoMatch
from npu_graph.passes.matching.materialize import materialize
from npu_graph.passes.matching.values import is_zero, strip_views, val

aten = torch.ops.aten
Node = torch.fx.Node
SCATTERS = {aten.scatter.src, aten.scatter_add.default}


@dataclass
class DenseExperts:
    anchor: Node
    tracer: Tracer
    x: Node
    weights: Node
    ids: Node
    gate: Node
    up: Node
    down: Node
    axes: dict[str, Axis]     # e, t, h, i


def routing_matrix(node: Node) -> tuple[Node, Node] | None:
    """(w, ids) when node is zeros(T, E).scatter(1, ids, w) or its scatter_add."""
    node = strip_views(node)
    if not isinstance(node, Node) or node.target not in SCATTERS or node.args[1] not in (1, -1):
        return None
    return (node.args[3], node.args[2]) if is_zero(node.args[0]) else None


def candidate(node: Node) -> bool:
    """A cheap look: a routing matrix among the few nodes above the combine."""
    frontier = list(node.all_input_nodes)
    for _ in range(5):
        if any(routing_matrix(n) for n in frontier):
            return True
        frontier = [i for n in frontier for i in n.all_input_nodes]
    return False


def _roots(tracer: Tracer, node: Node) -> list[Axis]:
    return [find(a) for d in tracer.memo[node].dims for a in flat(d)]


def _projection(tracer: Tracer, expr: Expr) -> tuple[Node, Node, Contraction]:
    """(x, W) of Σ_h x · W over one reduced axis."""
    c = contraction(tracer, expr)
    leaves = [as_leaf(tracer, f).node for f in c.factors]
    if len(leaves) != 2 or len(c.reduced) != 1 or c.scale != 1.0 or c.scalars:
        raise NoMatch("an expert projection is not x · W over the hidden dim")
    x, w = sorted(leaves, key=lambda n: val(n).dim())
    return x, w, c


def _activation(tracer: Tracer, factors: list[Expr], structure: Structure) -> tuple[Expr, Expr]:
    """(gate contraction, up contraction) among the act factors silu(g) · u (or g · sigmoid(g) · u)."""
    for i, f in enumerate(factors):
        rest = factors[:i] + factors[i + 1:]
        if f.kind == "unary" and silu_of(f.node, structure) is not None and len(rest) == 1:
            return f.factors[0], rest[0]
        if f.kind == "unary" and f.node.target == aten.sigmoid.default and len(rest) == 2:
            for g, u in (rest, rest[::-1]):
                if structure.same(g.node, f.factors[0].node):
                    return g, u
    raise NoMatch("the experts' activation is not silu(gate) · up", near=False)


def _weight_leaf(tracer: Tracer, factors: list[Expr]) -> tuple[Node, list[Expr]]:
    """The stacked down weights (a 3-d leaf) and the other factors of the down product."""
    for i, f in enumerate(factors):
        if f.kind == "leaf" and val(f.node) is not None and val(f.node).dim() == 3:
            return as_leaf(tracer, f).node, factors[:i] + factors[i + 1:]
    raise NoMatch("the experts' down projection has no stacked [E, H, I] weight", near=False)


def match_dense(anchor: Node, structure: Structure) -> DenseExperts:
    tracer = Tracer()
    top = contraction(tracer, tracer.trace(anchor).expr)
    routing = [f for f in top.factors if f.kind == "leaf" and routing_matrix(f.node)]
    if len(top.factors) != 2 or len(routing) != 1 or len(top.reduced) != 1 or top.scale != 1.0:
        raise NoMatch("not Σ_e D[t, e] · expert_e(x) with D the routing weights scattered to the experts",
                      near=False)
    w, ids = routing_matrix(routing[0].node)
    down = contraction(tracer, next(f for f in top.factors if f is not routing[0]))
    wd, act = _weight_leaf(tracer, down.factors)
    gate, up = _activation(tracer, act, structure)
    (xg, wg, cg), (xu, wu, cu) = _projection(tracer, gate), _projection(tracer, up)
    if not structure.same(xg, xu) or len(down.reduced) != 1 or \
            {id(find(a)) for a in flat(list(cg.reduced))} != {id(find(a)) for a in flat(list(cu.reduced))}:
        raise NoMatch("gate and up do not project the same tokens over the same hidden dim")
    e, h, i = (find(next(iter(flat(list(c.reduced))))) for c in (top, cg, down))
    token = [a for a in _roots(tracer, xg) if a is not h]
    if len(token) != 1:
        raise NoMatch("the tokens are not [T, H]")
    axes = {"e": e, "t": token[0], "h": h, "i": i}
    for name, node in (("gate", wg), ("up", wu)):
        if set(map(id, _roots(tracer, node))) != {id(e), id(i), id(h)}:
            raise NoMatch(f"the {name} weights are not [E, I, H] over the experts' axes")
    return DenseExperts(anchor, tracer, xg, w, ids, wg, wu, wd, axes)


def rewrite_dense(gm: torch.fx.GraphModule, m: DenseExperts) -> None:
    graph, a, tracer = gm.graph, m.axes, m.tracer
    out_dims = tracer.trace(m.anchor).dims
    h_out = [x for d in out_dims for x in flat(d) if find(x) is not find(a["t"])]
    if len(h_out) != 1:
        raise NoMatch("the combined output is not [T, H]")
    with graph.inserting_before(m.anchor):
        gate = materialize(graph, m.gate, tracer.leaf_dims[m.gate], [(a["e"],), (a["i"],), (a["h"],)])
        up = materialize(graph, m.up, tracer.leaf_dims[m.up], [(a["e"],), (a["i"],), (a["h"],)])
        w13 = graph.call_function(aten.cat.default, ([gate, up], 1))
        w2 = materialize(graph, m.down, tracer.leaf_dims[m.down], [(a["e"],), (h_out[0],), (a["i"],)])
        x = materialize(graph, m.x, tracer.leaf_dims[m.x], [(a["t"],), (a["h"],)])
        fused = graph.call_function(torch.ops.ascend_dsa.fused_moe.default, (x, w13, w2, m.weights, m.ids))
        out = materialize(graph, fused, [(a["t"],), (h_out[0],)], out_dims)
    m.anchor.replace_all_uses_with(out)

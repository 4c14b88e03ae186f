"""Routed experts written densely (every expert on every token, as stacked weights and batched products), for
fuse_moe_experts. In canonical terms (passes/canonical/terms.py):

    out[t, h] = Σ_e D[t, e] · Σ_i act[e, t, i] · Wd[e, h, i],   act = silu(Σ_h x·Wg[e, i, h]) · Σ_h x·Wu[e, i, h]
    D = zeros(T, E).scatter(1, ids, w)  (or scatter_add)

with the products in any spelling (bmm of an expanded x, einsum, matmul with transposes, multiply + sum) and silu
spelled silu(g) or g · sigmoid(g). D holds each token's routing weights at its experts, so the sum over e is the
routed combine Σ_j w[t, j] · expert_{ids[t, j]}(x[t]) that fused_moe computes. The same combine written per routed
slot s = t·k + j:

    out = zeros(T, H).index_add(0, tok, E_out[ids.flatten(), tok] · w.flatten()[:, None]),   tok[s] = s // k

with E_out[e, t, h] the dense experts' output and tok spelled `s // k` or `arange(T)[:, None].expand(T, k)` flattened.
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
from npu_graph.passes.matching.values import CASTS, RESHAPES, UNIT_DIMS, is_zero, same_size, strip, strip_views, val

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
    axes: dict[str, Axis]     # e, t, h (the tokens' hidden dim), i, o (the output's hidden dim)
    out_dims: list | None = None   # the anchor's dims over the axes; None: [T, H] as fused_moe returns it


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


def _experts(tracer: Tracer, down_expr: Expr, e: Axis, structure: Structure) -> tuple[Node, Node, Node, Node, dict]:
    """(x, gate, up, down weights, axes e/t/h/i) of Σ_i act[e, t, i] · Wd[e, h, i] over the expert axis e."""
    down = contraction(tracer, down_expr)
    wd, act = _weight_leaf(tracer, down.factors)
    gate, up = _activation(tracer, act, structure)
    (xg, wg, cg), (xu, wu, cu) = _projection(tracer, gate), _projection(tracer, up)
    if not structure.same(xg, xu) or len(down.reduced) != 1 or \
            {id(find(a)) for a in flat(list(cg.reduced))} != {id(find(a)) for a in flat(list(cu.reduced))}:
        raise NoMatch("gate and up do not project the same tokens over the same hidden dim")
    h, i = (find(next(iter(flat(list(c.reduced))))) for c in (cg, down))
    token = [a for a in _roots(tracer, xg) if a is not h]
    if len(token) != 1:
        raise NoMatch("the tokens are not [T, H]")
    for name, node in (("gate", wg), ("up", wu)):
        if set(map(id, _roots(tracer, node))) != {id(e), id(i), id(h)}:
            raise NoMatch(f"the {name} weights are not [E, I, H] over the experts' axes")
    return xg, wg, wu, wd, {"e": e, "t": token[0], "h": h, "i": i}


def match_dense(anchor: Node, structure: Structure) -> DenseExperts:
    tracer = Tracer()
    top = contraction(tracer, tracer.trace(anchor).expr)
    routing = [f for f in top.factors if f.kind == "leaf" and routing_matrix(f.node)]
    if len(top.factors) != 2 or len(routing) != 1 or len(top.reduced) != 1 or top.scale != 1.0:
        raise NoMatch("not Σ_e D[t, e] · expert_e(x) with D the routing weights scattered to the experts",
                      near=False)
    w, ids = routing_matrix(routing[0].node)
    e = find(next(iter(flat(list(top.reduced)))))
    x, gate, up, down, axes = _experts(tracer, next(f for f in top.factors if f is not routing[0]), e, structure)
    out_dims = tracer.trace(anchor).dims
    h_out = [a for d in out_dims for a in flat(d) if find(a) is not find(axes["t"])]
    if len(h_out) != 1:
        raise NoMatch("the combined output is not [T, H]")
    return DenseExperts(anchor, tracer, x, w, ids, gate, up, down, {**axes, "o": h_out[0]}, out_dims)


def _is_range(node: object, length: object) -> bool:
    """node is arange(length) (from 0, step 1)."""
    if not isinstance(node, Node) or node.target not in (aten.arange.default, aten.arange.start,
                                                          aten.arange.start_step):
        return False
    start = node.args[0] if node.target != aten.arange.default else 0
    step = node.args[2] if node.target == aten.arange.start_step else 1
    return start == 0 and step == 1 and same_size(val(node).shape[0], length)


def slot_tokens(node: object, tokens: object, k: int) -> bool:
    """node is the token of each routed slot s = t·k + j of a [T, k] routing, flattened: s // k, or
    arange(T)[:, None].expand(T, k) flattened (row-major, so a [T, 1] column of the range broadcast over k)."""
    node = strip(node, RESHAPES | CASTS)
    if not isinstance(node, Node):
        return False
    floor = node.target == aten.floor_divide.default or (
        node.target == aten.div.Tensor_mode and node.kwargs.get("rounding_mode") == "floor")
    if floor:
        return node.args[1] == k and _is_range(node.args[0], tokens * k)
    if node.target != aten.expand.default:
        return False
    column = node.args[0]
    shape, column_shape = val(node).shape, val(column).shape
    return len(shape) == 2 and same_size(shape[0], tokens) and shape[1] == k and len(column_shape) == 2 \
        and same_size(column_shape[0], tokens) and column_shape[1] == 1 and \
        _is_range(strip(column, RESHAPES | UNIT_DIMS), tokens)


def _flat_routing(node: object) -> Node | None:
    """The [T, k] routing tensor that node flattens row-major (reshapes and unit dims only: a copy may have
    transposed it)."""
    inner = strip(node, RESHAPES | UNIT_DIMS)
    return inner if isinstance(inner, Node) and val(inner) is not None and val(inner).dim() == 2 else None


def _picked_rows(source: Node) -> tuple[Node, Node, Node, Node]:
    """(expert outputs [E, T, H], weights, ids, tokens) of E_out[ids.flatten(), tok] · w.flatten()[:, None]."""
    if source.target != aten.mul.Tensor:
        raise NoMatch("the added rows are not expert rows times routing weights", near=False)
    for picked, weight in (source.args[:2], source.args[1::-1]):
        picked = strip(picked, CASTS)
        if isinstance(picked, Node) and picked.target == aten.index.Tensor and len(picked.args[1]) == 2 \
                and None not in picked.args[1]:
            ids, weights = _flat_routing(picked.args[1][0]), _flat_routing(weight)
            if ids is not None and weights is not None:
                return picked.args[0], weights, ids, picked.args[1][1]
    raise NoMatch("the added rows are not E_out[ids.flatten(), tok] · w.flatten()", near=False)


def match_index_add(anchor: Node, structure: Structure) -> DenseExperts:
    """zeros(T, H).index_add(0, tok, E_out[ids.flatten(), tok] · w.flatten()[:, None]) over dense experts."""
    if anchor.args[1] != 0 or not is_zero(anchor.args[0]) or anchor.kwargs.get("alpha", 1) != 1:
        raise NoMatch("not an index_add of rows onto zeros", near=False)
    outs, weights, ids, tokens = _picked_rows(anchor.args[3])
    t, k = val(ids).shape
    if val(weights).shape != val(ids).shape or not slot_tokens(tokens, t, k) or not (
            structure.same(tokens, anchor.args[2]) or slot_tokens(anchor.args[2], t, k)):
        raise NoMatch("the rows are not added onto the tokens of their routed slots (tok = slot // k)")
    tracer = Tracer()
    traced = tracer.trace(outs)
    if len(traced.dims) != 3:
        raise NoMatch("the picked expert outputs are not [E, T, H]")
    e, t_axis, o = (find(next(iter(flat(d)))) for d in traced.dims)
    x, gate, up, down, axes = _experts(tracer, traced.expr, e, structure)
    if t_axis is not find(axes["t"]) or val(anchor).shape != val(x).shape:
        raise NoMatch("the expert outputs are not [E, T, H] over the tokens the sum adds onto")
    return DenseExperts(anchor, tracer, x, weights, ids, gate, up, down, {**axes, "o": o})


def rewrite_dense(gm: torch.fx.GraphModule, m: DenseExperts) -> None:
    graph, a, tracer = gm.graph, m.axes, m.tracer
    with graph.inserting_before(m.anchor):
        gate = materialize(graph, m.gate, tracer.leaf_dims[m.gate], [(a["e"],), (a["i"],), (a["h"],)])
        up = materialize(graph, m.up, tracer.leaf_dims[m.up], [(a["e"],), (a["i"],), (a["h"],)])
        w13 = graph.call_function(aten.cat.default, ([gate, up], 1))
        w2 = materialize(graph, m.down, tracer.leaf_dims[m.down], [(a["e"],), (a["o"],), (a["i"],)])
        x = materialize(graph, m.x, tracer.leaf_dims[m.x], [(a["t"],), (a["h"],)])
        out = graph.call_function(torch.ops.ascend_dsa.fused_moe.default, (x, w13, w2, m.weights, m.ids))
        if m.out_dims is not None:
            out = materialize(graph, out, [(a["t"],), (a["o"],)], m.out_dims)
    m.anchor.replace_all_uses_with(out)

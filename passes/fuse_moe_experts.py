"""fuse_moe_experts: routed SwiGLU experts -> `ascend_dsa.fused_moe`, anchored on the combine; x [T, H],
routing weights and ids [T, k]:
- loop: acc = 0; for every expert e: acc = acc + down_e(silu(gate_e(x)) * up_e(x)) * Σ_j w[:, j]·(ids[:, j] == e)
  (the reference model, and per-expert loops as model authors write them);
- grouped: transformers' grouped_mm experts: perm = sort(ids.flatten()), grouped_mm(x[perm // k], w13ᵀ, offs),
  silu(gate) * up over the halves of its output, grouped_mm(., w2ᵀ, offs) * w.flatten()[perm], inverse
  permutation, view(T, k, H).sum(1)
- dense: every expert on every token over stacked weights (bmm, einsum), combined with the routing weights
  scattered to a [T, E] matrix, or each routed slot's expert row weighted and index_add-ed back onto its token
  (passes/matching/dense_experts.py);
  -> fused_moe(x, w13 [E, 2I, H], w2 [E, H, I], w, ids)
Loop experts keep their weights as separate graph inputs (parameters lifted by Dynamo): the pass stacks them
into w13/w2 inside the graph, which copies every expert's weights on each call; grouped experts are
already stacked. The routing (top-k ids and weights) is left to fuse_moe_gating, which runs next; the ids
may come from either form.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.canonical.reading import halves, sigmoid_of, silu_of, transposed
from npu_graph.passes.canonical.structure import Structure
from npu_graph.passes.matching import dense_experts
from npu_graph.passes.matching.fusion_graph import fuse_each
from npu_graph.passes.matching.match_util import NoMatch
from npu_graph.passes.matching.values import RESHAPES, arg, is_last_dim, is_zero, strip, strip_casts, strip_views, val

NAME = "fuse_moe_experts"
INFERENCE_ONLY = True
PATTERN_LOOP = "Σ_e expert_e(x) · Σ_j w·(ids == e)"
PATTERN_GROUPED = "grouped_mm experts (sorted by expert) -> weighted sum over k"
PATTERN_DENSE = "Σ_e scatter(ids, w)[t, e] · expert_e(x) over stacked weights"
PATTERN_INDEX_ADD = "index_add(0, slot // k, expert_ids(x)[slot] · w[slot]) over stacked weights"
LABEL = "routed experts"

aten = torch.ops.aten
Node = torch.fx.Node
_GROUPED_MM = ("transformers.grouped_mm_fallback.default", "aten._grouped_mm.default")


@dataclass
class Experts:
    pattern: str
    anchor: Node
    x: Node
    weights: Node
    ids: Node
    loop: list[tuple[Node, Node, Node]] | None = None  # (gate, up, down) weights of expert 0, 1, ...
    stacked: tuple[Node, Node] | None = None          # grouped_mm weights [E, H, 2I] and [E, I, H]


@dataclass
class Term:
    x: Node
    gate: Node
    up: Node
    down: Node
    weights: Node
    ids: Node
    expert: int


def _linear(node: object) -> tuple[Node, Node] | None:
    """(input, weight) of input @ weightᵀ (mm of the input and a transposed 2-d weight)."""
    node = strip(node, RESHAPES)
    if not isinstance(node, Node) or node.target != aten.mm.default:
        return None
    weight = transposed(node.args[1])
    return (node.args[0], weight) if weight is not None else None


def _product(node: object) -> list[Node]:
    """The factors of an elementwise product in any association (products feeding only it are opened)."""
    factors, pending = [], [node]
    while pending:
        current = strip(pending.pop(), RESHAPES)
        opened = current is node or len(current.users) == 1
        if isinstance(current, Node) and current.target == aten.mul.Tensor and opened \
                and all(isinstance(a, Node) for a in current.args[:2]):
            pending += list(current.args[1::-1])
        else:
            factors.append(current)
    return factors


def _gated_linears(node: Node, structure: Structure) -> tuple[tuple[Node, Node], tuple[Node, Node]] | None:
    """(gate linear, up linear) of silu(gate(x)) · up(x), silu spelled silu(g) or g · sigmoid(g)."""
    factors = _product(node)
    for i, f in enumerate(factors):
        gate = silu_of(f, structure)
        rest = factors[:i] + factors[i + 1:]
        if gate is None:
            inner = sigmoid_of(f)
            match = next((g for g in rest if inner is not None and structure.same(g, inner)), None)
            gate, rest = (match, [g for g in rest if g is not match]) if match is not None else (None, rest)
        if gate is not None and len(rest) == 1:
            linears = _linear(gate), _linear(rest[0])
            if all(linears):
                return linears
    return None


def _swiglu(node: Node, structure: Structure) -> tuple[Node, Node, Node, Node] | None:
    """(x, gate, up, down weights) of down(silu(gate(x)) * up(x))."""
    down = _linear(node)
    act = strip(down[0], RESHAPES) if down else None
    found = _gated_linears(act, structure) if isinstance(act, Node) and act.target == aten.mul.Tensor else None
    if found is None:
        return None
    gate, up = found
    return (gate[0], gate[1], up[1], down[1]) if strip_views(gate[0]) is strip_views(up[0]) else None


def _slot_weight(node: Node) -> tuple[Node, Node, int] | None:
    """(weights, ids, e) of Σ_j weights[:, j] · (ids[:, j] == e), as mul or where(ids == e, weights, 0)."""
    total = strip_views(node)
    if not isinstance(total, Node) or total.target != aten.sum.dim_IntList or len(total.args[1]) != 1:
        return None
    product = strip_casts(total.args[0])
    if not is_last_dim(total.args[1][0], product):
        return None
    if product.target == aten.mul.Tensor:
        pairs = [(strip_casts(a), b) for a, b in (product.args[:2], product.args[1::-1])]
    elif product.target in (aten.where.self, aten.where.ScalarOther) and is_zero(product.args[2]):
        pairs = [(product.args[0], product.args[1])]
    else:
        return None
    for eq, weights in pairs:
        if isinstance(eq, Node) and eq.target == aten.eq.Scalar and isinstance(eq.args[1], int):
            return weights, eq.args[0], eq.args[1]
    return None


def _term(node: object, structure: Structure) -> Term | None:
    if not isinstance(node, Node) or node.target != aten.mul.Tensor:
        return None
    for out, weight in (node.args[:2], node.args[1::-1]):
        expert, slot = _swiglu(out, structure) if isinstance(out, Node) else None, _slot_weight(weight)
        if expert and slot:
            return Term(*expert, *slot)
    return None


def _routed(node: Node) -> bool:
    """A product with a routing weight Σ_j w·(ids == e) among its factors."""
    return node.target == aten.mul.Tensor and any(isinstance(a, Node) and _slot_weight(a) for a in node.args[:2])


def _summed(anchor: Node) -> tuple[list[Node], list[Node]]:
    """The terms a sum adds up in any association (adds feeding only it are opened; sum(stack(terms), 0) too),
    zeros left out, and the add nodes opened."""
    terms, adds, pending = [], [], [anchor]
    while pending:
        node = pending.pop()
        inner = node is anchor or len(node.users) == 1
        if inner and node.target == aten.add.Tensor and not node.kwargs and len(node.args) == 2 \
                and all(isinstance(a, Node) for a in node.args):
            adds.append(node)
            pending += list(node.args[::-1])
        elif node is anchor and node.target == aten.sum.dim_IntList and list(node.args[1]) in ([0], [-val(
                node.args[0]).dim()]) and getattr(node.args[0], "target", None) == aten.stack.default \
                and arg(node.args[0], 1, 0) == 0:
            pending += list(node.args[0].args[0])[::-1]
        elif not is_zero(node):
            terms.append(node)
    return terms, adds


def _expert_count(ids: Node) -> object:
    """How many experts the routed ids can name (the width of the scores they were picked from)."""
    source = strip_casts(ids)
    if source.target is operator.getitem and source.args[1] == 1:
        producer = source.args[0]
        if producer.target in (aten.topk.default, torch.ops.ascend_dsa.moe_gating_top_k.default):
            return val(producer.args[0]).shape[-1]
    return None


def _check_routing(x: Node, weights: Node, ids: Node, experts: int) -> None:
    wv, iv, xv = val(weights), val(ids), val(x)
    if xv is None or xv.dim() != 2 or wv is None or iv is None or wv.dim() != 2 or wv.shape != iv.shape:
        raise NoMatch("tokens are not [T, H] with routing weights and ids [T, k]")
    if not wv.dtype.is_floating_point or iv.dtype not in (torch.int32, torch.int64):
        raise NoMatch("routing weights are not floating point or ids are not int32/int64")
    if _expert_count(ids) != experts:
        raise NoMatch(f"the routed ids are not shown to lie in [0, {experts})")


def match_loop(anchor: Node, terms: list[Term]) -> Experts:
    first = terms[0]
    if sorted(t.expert for t in terms) != list(range(len(terms))):
        raise NoMatch(f"the loop covers experts {sorted(t.expert for t in terms)}, not 0..{len(terms) - 1}")
    for t in terms:
        same = (strip_views(t.x) is strip_views(first.x), strip_casts(t.weights) is strip_casts(first.weights),
                strip_casts(t.ids) is strip_casts(first.ids))
        if not all(same):
            raise NoMatch("experts read different tokens or routing tensors")
        if any(val(w).dtype != val(first.x).dtype for w in (t.gate, t.up, t.down)):
            raise NoMatch("expert weights and tokens have different dtypes")
    _check_routing(first.x, first.weights, first.ids, len(terms))
    if val(anchor).shape != val(first.x).shape:
        raise NoMatch("the combined output is not [T, H]")
    loop = [(t.gate, t.up, t.down) for t in sorted(terms, key=lambda t: t.expert)]
    return Experts(PATTERN_LOOP, anchor, first.x, first.weights, first.ids, loop=loop)


def _is_grouped_mm(node: object) -> bool:
    return isinstance(node, Node) and str(node.target) in _GROUPED_MM


def _offsets_ok(offs: Node, sort: Node, experts: int) -> bool:
    """offs = cumsum(histc(sorted ids, E, 0, E - 1)): the group boundaries of the sorted ids."""
    if offs.target != aten.cumsum.default:
        return False
    histc = offs.args[0]
    if histc.target != aten.histc.default or tuple(histc.args[1:4]) != (experts, 0, experts - 1):
        return False
    values = strip_casts(histc.args[0])
    return values.target is operator.getitem and values.args[0] is sort and values.args[1] == 0


def _gated(node: Node) -> Node | None:
    """The up-projection `u` of silu(u[:, :I]) * u[:, I:] (the halves of the last dim: canonical_form makes a
    two-way split or chunk slices)."""
    if node.target != aten.mul.Tensor:
        return None
    for gate, up in (node.args[:2], node.args[1::-1]):
        if getattr(gate, "target", None) == aten.silu.default:
            u = halves(gate.args[0], up)
            if u is not None:
                return u
    return None


def _sorted_rows(node: Node) -> tuple[Node, Node]:
    """(perm, sort) for rows reordered by perm = sort(ids.flatten()).indices."""
    if node.target != aten.index.Tensor or len(node.args[1]) != 1:
        raise NoMatch("rows are not reordered by an index")
    perm = node.args[1][0]
    if perm.target is not operator.getitem or perm.args[1] != 1 or perm.args[0].target != aten.sort.default:
        raise NoMatch("rows are not reordered by sorted expert ids")
    return perm, perm.args[0]


def _gmm_parts(node: Node) -> tuple[Node, Node, Node]:
    offs = arg(node, 2, None, "offs")
    return node.args[0], node.args[1], offs


def _grouped_head(anchor: Node) -> tuple[Node, Node, Node]:
    """(inverse permutation, grouped down projection, per-row weight) of the combine."""
    if anchor.target != aten.sum.dim_IntList or list(anchor.args[1]) != [1] or arg(anchor, 2, False):
        raise NoMatch("not a sum over the k routed slots", near=False)
    restored = strip(anchor.args[0], RESHAPES)
    if not isinstance(restored, Node) or restored.target != aten.index.Tensor or len(restored.args[1]) != 1:
        raise NoMatch("slots are not gathered back from expert order", near=False)
    weighted = restored.args[0]
    if weighted.target != aten.mul.Tensor:
        raise NoMatch("expert rows are not weighted", near=False)
    for down, scale in (weighted.args[:2], weighted.args[1::-1]):
        if _is_grouped_mm(down):
            return restored.args[1][0], down, scale
    raise NoMatch("expert rows do not come from a grouped matmul", near=False)


def match_grouped(anchor: Node) -> Experts:
    inverse, down, scale = _grouped_head(anchor)
    perm, sort = _sorted_rows(strip_views(scale))
    if inverse.target != aten.index_put.default or list(inverse.args[1]) != [perm] \
            or inverse.args[2].target != aten.arange.default or arg(sort, 2, False):
        raise NoMatch("rows are not restored by the inverse of the expert sort")
    act, w2, offs = _gmm_parts(down)
    up = _gated(act)
    if not _is_grouped_mm(up) or _gmm_parts(up)[2] is not offs:
        raise NoMatch("the activation is not silu(gate) * up of a grouped matmul with the same offsets")
    rows, w13, _ = _gmm_parts(up)
    rows = strip_casts(rows)
    ids, weights = strip_views(sort.args[0]), strip_views(strip_views(scale).args[0])
    k = val(ids).shape[-1]
    by_token = rows.args[1][0] if rows.target == aten.index.Tensor and len(rows.args[1]) == 1 else None
    if by_token is None or by_token.target != aten.floor_divide.default or by_token.args[0] is not perm \
            or by_token.args[1] != k:
        raise NoMatch("expert inputs are not the tokens of the sorted slots (x[perm // k])")
    experts, hidden = val(w13).shape[0], val(rows.args[0]).shape[-1]
    if not _offsets_ok(offs, sort, experts) or val(w2).shape[0] != experts:
        raise NoMatch("group offsets are not the histogram of the sorted ids over all experts")
    if tuple(val(w13).shape[1:]) != (hidden, 2 * val(w2).shape[1]) or val(w2).shape[2] != hidden:
        raise NoMatch("expert weights are not [E, H, 2I] and [E, I, H]")
    if tuple(val(anchor.args[0]).shape) != (val(ids).shape[0], k, hidden):
        raise NoMatch("the combine is not a sum over [T, k, H]")
    _check_routing(rows.args[0], weights, ids, experts)
    return Experts(PATTERN_GROUPED, anchor, rows.args[0], weights, ids, stacked=(w13, w2))


def _expert_weights(graph: torch.fx.Graph, m: Experts) -> tuple[Node, Node]:
    """w13 [E, 2I, H] (gate rows first) and w2 [E, H, I]."""
    if m.loop is not None:
        gates, ups, downs = ([w[i] for w in m.loop] for i in range(3))
        w13 = graph.call_function(aten.cat.default, ([graph.call_function(aten.stack.default, (gates,)),
                                                      graph.call_function(aten.stack.default, (ups,))], 1))
        return w13, graph.call_function(aten.stack.default, (downs,))
    out = []
    for w in m.stacked:
        swapped = w.target == aten.transpose.int and {d % 3 for d in w.args[1:]} == {1, 2}
        out.append(w.args[0] if swapped else graph.call_function(aten.transpose.int, (w, 1, 2)))
    return out[0], out[1]


def rewrite(gm: torch.fx.GraphModule, m: Experts) -> None:
    graph = gm.graph
    with graph.inserting_before(m.anchor):
        w13, w2 = _expert_weights(graph, m)
        x, dtype = m.x, val(m.stacked[0] if m.stacked else m.loop[0][0]).dtype
        if val(x).dtype != dtype:
            x = graph.call_function(aten._to_copy.default, (x,), {"dtype": dtype})
        out = graph.call_function(torch.ops.ascend_dsa.fused_moe.default, (x, w13, w2, m.weights, m.ids))
        if val(m.anchor).dtype != dtype:
            out = graph.call_function(aten._to_copy.default, (out,), {"dtype": val(m.anchor).dtype})
    m.anchor.replace_all_uses_with(out)


def _fuse(gm: torch.fx.GraphModule, seen: set[Node], structure: Structure, node: Node) -> str:
    """Fuse the experts whose combine is `node`; the adds inside a sum of expert terms are not tried again."""
    if node in seen:
        raise NoMatch("an add inside a sum of expert terms", near=False)
    index_add = node.target == aten.index_add.default
    if index_add or dense_experts.candidate(node):
        found_dense = (dense_experts.match_index_add if index_add else dense_experts.match_dense)(node, structure)
        _check_routing(found_dense.x, found_dense.weights, found_dense.ids, val(found_dense.down).shape[0])
        dense_experts.rewrite_dense(gm, found_dense)
        return PATTERN_INDEX_ADD if index_add else PATTERN_DENSE
    grouped = node.target == aten.sum.dim_IntList and list(node.args[1]) == [1]
    if grouped:
        found = match_grouped(node)
    else:
        nodes, adds = _summed(node)
        terms = [_term(n, structure) for n in nodes]
        if not nodes or any(t is None for t in terms) or len(terms) < 2:
            routed = len(nodes) >= 2 and all(_routed(n) for n in nodes)
            raise NoMatch("a sum of routed terms whose expert is not down(silu(gate(x)) · up(x))", near=routed,
                          differs="an expert of another activation where the pattern has SwiGLU") if routed \
                else NoMatch("not a sum of expert terms", near=False)
        seen.update(adds)
        found = match_loop(node, terms)
    rewrite(gm, found)
    return found.pattern


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    seen: set[Node] = set()
    structure = Structure(gm.graph)
    return fuse_each(gm, {aten.sum.dim_IntList, aten.add.Tensor, aten.bmm.default, aten.mm.default,
                          aten.index_add.default},
                     lambda node: _fuse(gm, seen, structure, node), LABEL, reverse=True)

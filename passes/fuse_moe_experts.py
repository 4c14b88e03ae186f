"""fuse_moe_experts: routed SwiGLU experts -> `ascend_dsa.fused_moe`, anchored on the combine; x [T, H],
routing weights and ids [T, k]:
- loop: acc = 0; for every expert e: acc = acc + down_e(silu(gate_e(x)) * up_e(x)) * Σ_j w[:, j]·(ids[:, j] == e)
  (the reference model, and per-expert loops as model authors write them);
- grouped: transformers' grouped_mm experts: perm = sort(ids.flatten()), grouped_mm(x[perm // k], w13ᵀ, offs),
  silu(gate) * up over the halves of its output, grouped_mm(., w2ᵀ, offs) * w.flatten()[perm], inverse
  permutation, view(T, k, H).sum(1)
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
from npu_graph.passes.canonical.reading import halves
from npu_graph.passes.matching.fusion_graph import fuse_each
from npu_graph.passes.matching.match_util import NoMatch
from npu_graph.passes.matching.values import RESHAPES, arg, is_last_dim, is_zero, strip, strip_casts, strip_views, val

NAME = "fuse_moe_experts"
INFERENCE_ONLY = True
PATTERN_LOOP = "Σ_e expert_e(x) · Σ_j w·(ids == e)"
PATTERN_GROUPED = "grouped_mm experts (sorted by expert) -> weighted sum over k"
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
    """(input, weight) of input @ weightᵀ written as mm(input, t(weight))."""
    node = strip(node, RESHAPES)
    if not isinstance(node, Node) or node.target != aten.mm.default:
        return None
    rhs = node.args[1]
    swapped = rhs.target == aten.transpose.int and rhs.args[1] % 2 != rhs.args[2] % 2
    if (rhs.target == aten.t.default or swapped) and val(rhs.args[0]).dim() == 2:
        return node.args[0], rhs.args[0]
    return None


def _swiglu(node: Node) -> tuple[Node, Node, Node, Node] | None:
    """(x, gate, up, down weights) of down(silu(gate(x)) * up(x))."""
    down = _linear(node)
    act = strip(down[0], RESHAPES) if down else None
    if not isinstance(act, Node) or act.target != aten.mul.Tensor:
        return None
    for silu, up in (act.args, act.args[::-1]):
        silu = strip(silu, RESHAPES)
        if isinstance(silu, Node) and silu.target == aten.silu.default:
            gate, up = _linear(silu.args[0]), _linear(up)
            if gate and up and strip_views(gate[0]) is strip_views(up[0]):
                return gate[0], gate[1], up[1], down[1]
    return None


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


def _term(node: object) -> Term | None:
    if not isinstance(node, Node) or node.target != aten.mul.Tensor:
        return None
    for out, weight in (node.args[:2], node.args[1::-1]):
        expert, slot = _swiglu(out) if isinstance(out, Node) else None, _slot_weight(weight)
        if expert and slot:
            return Term(*expert, *slot)
    return None


def _chain(anchor: Node) -> tuple[list[Term], Node | None, list[Node]]:
    """Expert terms summed by a chain of adds ending at `anchor`, the chain's start and its add nodes."""
    terms, adds, node = [], [], anchor
    while node.target == aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
        term, acc = _term(node.args[1]), node.args[0]
        if term is None:
            term, acc = _term(node.args[0]), node.args[1]
        if term is None or not isinstance(acc, Node):
            break
        terms.append(term)
        adds.append(node)
        node = acc
    first = _term(node) if terms else None
    if first is not None:
        return [*terms, first], None, adds
    return terms, node, adds


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


def match_loop(anchor: Node, terms: list[Term], start: Node | None) -> Experts:
    if start is not None and not is_zero(start):
        raise NoMatch("the expert sum does not start from zero")
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


def _fuse(gm: torch.fx.GraphModule, seen: set[Node], node: Node) -> str:
    """Fuse the experts whose combine is `node`; the adds of a loop's chain are not tried again."""
    if node in seen:
        raise NoMatch("an add inside a chain of expert terms", near=False)
    if node.target == aten.sum.dim_IntList:
        found = match_grouped(node)
    else:
        terms, start, adds = _chain(node)
        seen.update(adds)
        if not terms:
            raise NoMatch("not a sum of expert terms", near=False)
        found = match_loop(node, terms, start)
    rewrite(gm, found)
    return found.pattern


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    seen: set[Node] = set()
    return fuse_each(gm, {aten.sum.dim_IntList, aten.add.Tensor}, lambda node: _fuse(gm, seen, node), LABEL,
                     reverse=True)

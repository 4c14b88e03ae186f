"""fuse_attention: dense softmax attention in its decomposed forms -> one
`aten._scaled_dot_product_flash_attention_for_cpu` (the fused kernel SDPA itself dispatches to on CPU).

Pattern (anchored on the P·V matmul):
    out = softmax(c · q·kᵀ (+ additive mask) (masked_fill / where with -inf)) @ v
q·kᵀ and P·V may be written with matmul, bmm or einsum, with dtype casts around the softmax, with GQA
(repeat_kv / expand of k and v) and with the scale on the product or divided; `softmax` may also be
`_safe_softmax` (SDPA's math decomposition). axis_trace identifies the axes: shared by q, k and v (batch,
heads), query-only (rows, GQA groups), keys (the softmax axis), the q·k contraction and v's head dim. The
fused op gets q [B, Hq, L, D], k/v [B, Hk, S, D] (GQA native: query-only axes the masks do not vary along
become head groups), masks as one additive mask in q's dtype, broadcast where they do not vary. Different
q·k and v head dims are zero-padded to the larger one (exact).
Only when the softmax input is exactly c·q·kᵀ plus masks and v is a tensor of its own: softmax over depth
(AttnRes: a learned query with no token axes), MLA's absorbed form (v is k) and top-k sparse attention
(scatter-built masks, rows gathered by selected indices; fuse_sparse_attention's) are left alone.
Rows that mask every key give 0 where eager gives NaN (with an -inf fill).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.matching.axis_trace import (
    Axis,
    Dim,
    Expr,
    TraceError,
    Tracer,
    as_leaf,
    dim_size,
    flat,
    flatten,
    softmax_of,
    unify_dim,
)
from npu_graph.passes.matching.fusion_graph import fuse_matches
from npu_graph.passes.matching.match_util import NoMatch
from npu_graph.passes.matching.materialize import materialize
from npu_graph.passes.matching.values import fill_value, same_size, val

NAME = "fuse_attention"
INFERENCE_ONLY = True
PATTERN = "softmax(c·q·kᵀ + masks) @ v"

aten = torch.ops.aten
Node = torch.fx.Node
_SPARSE_SOURCES = {aten.topk.default, aten.sort.default, aten.scatter.value, aten.scatter.src, aten.gather.default}


@dataclass
class MaskTerm:
    """One mask on the score: `node` laid out as `dims` (axes of the score); additive, or bool with a fill."""

    node: Node
    dims: list[Dim]
    kind: str  # "additive" | "invisible" | "visible"
    fill: float = 0.0


@dataclass
class AttnMatch:
    anchor: Node
    tracer: Tracer
    q: Node
    k: Node
    v: Node
    scale: float
    masks: list[MaskTerm]
    keys: list[Axis]
    depth: list[Axis] = field(default_factory=list)
    value_depth: list[Axis] = field(default_factory=list)
    batch: list[Axis] = field(default_factory=list)
    heads: list[Axis] = field(default_factory=list)
    groups: list[Axis] = field(default_factory=list)
    rows: list[Axis] = field(default_factory=list)


def _ids(axes: object) -> set[int]:
    return {id(a) for a in flat(list(axes))}


def _leaf_axes(tracer: Tracer, node: Node) -> list[Axis]:
    return [a for d in tracer.leaf_dims[node] for a in flat(d)]


def _contracts(expr: Expr) -> bool:
    return expr.kind in ("matmul", "sum") or any(_contracts(f) for f in expr.factors)


def _value_is_a_key(tracer: Tracer, score: Expr, value: Node) -> bool:
    """v is a factor of one of the q·k products summed in the score: absorbed MLA, whose latent is both (a score
    of several products is otherwise a near miss, e.g. a relative-position term)."""
    product = flatten(score)
    terms = product.factors if product.kind == "add" else [product]
    return any(as_leaf(tracer, f).node is value for t in terms if t.kind == "matmul" for f in t.factors)


def _bool_mask(tracer: Tracer, node: Node) -> MaskTerm:
    """The bool mask of masked_fill(x, m, -inf) / where(m, x, -inf), its axes unified with the score's."""
    invisible = node.target == aten.masked_fill.Scalar
    mask = node.args[1] if invisible else node.args[0]
    traced = tracer.trace(mask)
    score_dims = tracer.memo[node].dims
    if len(traced.dims) > len(score_dims):
        raise NoMatch("the mask has more dims than the score")
    for mine, theirs in zip(traced.dims[::-1], score_dims[::-1]):
        if mine:
            unify_dim(mine, theirs)
    leaf = as_leaf(tracer, traced.expr)
    return MaskTerm(leaf.node, tracer.leaf_dims[leaf.node], "invisible" if invisible else "visible",
                    fill_value(node.args[2]))


def _peel_masks(tracer: Tracer, score: Expr) -> tuple[Expr, list[MaskTerm]]:
    """The score without its masks (-inf fills and additive terms free of contractions), and the masks."""
    masks = []
    while True:
        node = score.node
        if score.kind == "masked" and node.target in (aten.masked_fill.Scalar, aten.where.self):
            masks.append(_bool_mask(tracer, node))
            score = score.factors[0]
        elif score.kind == "add" and node.target == aten.add.Tensor \
                and [_contracts(f) for f in score.factors].count(True) == 1:
            i = [_contracts(f) for f in score.factors].index(True)
            leaf = as_leaf(tracer, score.factors[1 - i])
            masks.append(MaskTerm(leaf.node, tracer.leaf_dims[leaf.node], "additive"))
            score = score.factors[i]
        else:
            return score, masks


def _query_key(tracer: Tracer, score: Expr, keys: list[Axis]) -> tuple[Node, Node, list[Axis], float]:
    """(q, k, contracted axes in k's order, scale) of score = c · q·kᵀ."""
    product = score if score.kind == "matmul" else flatten(score)
    if product.kind not in ("matmul", "mul") or len(product.factors) != 2 or not product.reduced:
        raise NoMatch("the softmax input is not c·q·kᵀ (+ masks)", near=_contracts(score))
    a, b = (as_leaf(tracer, f).node for f in product.factors)
    key_ids = _ids(keys)
    q, k = (a, b) if key_ids <= _ids(_leaf_axes(tracer, b)) else (b, a)
    if not key_ids <= _ids(_leaf_axes(tracer, k)) or key_ids & _ids(_leaf_axes(tracer, q)):
        raise NoMatch("the softmax does not run over the key axis of q·kᵀ", near=False)
    reduced = _ids(product.reduced)
    depth = [a for a in _leaf_axes(tracer, k) if id(a) in reduced]
    return q, k, depth, product.scale


def _reaches(node: object, targets: set, depth: int) -> bool:
    """Whether `node` or an input within `depth` steps is one of `targets` or an ascend_dsa op."""
    frontier = [node] if isinstance(node, Node) else []
    for _ in range(depth + 1):
        for n in frontier:
            namespace = getattr(n.target, "namespace", None)
            if n.target in targets or namespace == "ascend_dsa":
                return True
        frontier = [i for n in frontier for i in n.all_input_nodes]
    return False


def _selected_rows(node: Node) -> bool:
    """Rows gathered at positions picked by a top-k (the gather form of sparse attention)."""
    while node.target in (aten.view.default, aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim,
                          aten.expand.default, aten.clone.default, aten._to_copy.default, aten.transpose.int):
        node = node.args[0]
    if node.target == aten.index.Tensor:
        indices = [i for i in node.args[1] if isinstance(i, Node)]
    elif node.target in (aten.gather.default, aten.index_select.default):
        indices = [node.args[2]]
    else:
        return False
    targets = _SPARSE_SOURCES | {aten.remainder.Scalar, aten.floor_divide.default}
    return any(_reaches(i, targets, 4) for i in indices)


def _is_sparse(m: AttnMatch) -> bool:
    scatters = {aten.scatter.value, aten.scatter.src, aten.scatter_add.default, aten.index_put.default}
    return any(_reaches(t.node, scatters, 4) for t in m.masks) or _selected_rows(m.k) or _selected_rows(m.v)


def _split(axes: list[Axis], varying: set[int]) -> tuple[list[Axis], list[Axis]]:
    return [a for a in axes if id(a) in varying], [a for a in axes if id(a) not in varying]


def _assign_axes(m: AttnMatch, score_dims: list[Dim]) -> None:
    """Shared axes -> batch (the masks vary along them) and heads; query-only axes -> rows and GQA groups."""
    tracer = m.tracer
    rq, rk, rv = (_ids(_leaf_axes(tracer, n)) for n in (m.q, m.k, m.v))
    keys, depth = _ids(m.keys), _ids(m.depth)
    if not rq - depth:
        raise NoMatch("the query has no token axes (a softmax over depth, not attention)", near=False)
    shared, query_only = [], []
    for a in flat([a for d in score_dims for a in d]):
        if id(a) in keys:
            continue
        if id(a) in rq & rk & rv:
            shared.append(a)
        elif id(a) in rq - rk - rv:
            query_only.append(a)
        else:
            raise NoMatch("a score axis is shared by q and only one of k, v")
    m.value_depth = [a for a in _leaf_axes(tracer, m.v) if id(a) not in _ids(shared) | keys]
    if not (rk <= _ids(shared) | keys | depth and rv.isdisjoint(depth) and rq.isdisjoint(keys)):
        raise NoMatch("k or v carry axes that are neither shared, keys nor head dims")
    varying = set().union(*(_ids(_mask_axes(t)) for t in m.masks)) if m.masks else set()
    m.batch, m.heads = _split(shared, varying)
    m.rows, m.groups = _split(query_only, varying)
    if not m.rows:
        m.rows, m.groups = m.groups, []


def _mask_axes(term: MaskTerm) -> list[Axis]:
    return [a for d in term.dims for a in flat(d)]


def match(anchor: Node) -> AttnMatch:
    tracer = Tracer()
    expr = tracer.trace(anchor).expr
    if expr.kind != "matmul" or len(expr.factors) != 2:
        raise NoMatch("not a matmul", near=False)
    found = [(s, f) for f in expr.factors for s in [softmax_of(tracer, f)] if s is not None]
    if len(found) != 1:
        raise NoMatch("not softmax(...) @ v", near=False)
    (inner, keys, softmax), _ = found[0]
    value = as_leaf(tracer, next(f for f in expr.factors if f is not found[0][1]))
    if _ids(keys) != _ids(expr.reduced):
        raise NoMatch("P·V does not contract the softmax axis", near=False)
    score, masks = _peel_masks(tracer, inner)
    if _value_is_a_key(tracer, score, value.node):
        raise NoMatch("v is the key of a score term (MLA absorbed form)", near=False)
    keys = list(flat(keys))  # the masks may have merged or split axes
    q, k, depth, scale = _query_key(tracer, score, keys)
    if value.node is k:
        raise NoMatch("v is k (MLA absorbed form)", near=False)
    m = AttnMatch(anchor, tracer, q, k, value.node, scale, masks, keys, depth)
    if _is_sparse(m):
        raise NoMatch("keys are selected by index (sparse attention)", near=False)
    _assign_axes(m, tracer.trace(softmax.args[0]).dims)
    expected = _ids(m.batch + m.heads + m.groups + m.rows + m.value_depth)
    if _ids(flat([a for d in tracer.trace(anchor).dims for a in d])) != expected:
        raise NoMatch("the output axes are not the query's and v's head dim")
    for term in m.masks:
        _mask_want(m, term)
    _head_dims(m)
    dtypes = {val(n).dtype for n in (q, k, value.node)}
    if len(dtypes) != 1 or not dtypes.pop().is_floating_point:
        raise NoMatch("q, k and v have different or non-float dtypes")
    return m


def _mask_want(m: AttnMatch, term: MaskTerm) -> list[Dim]:
    """The mask's layout as [batch, 1, rows, keys], each dim all of its axes or none (broadcast)."""
    mine = _ids(_mask_axes(term))
    want = []
    for group in (flat(m.batch), (), flat(m.rows), flat(m.keys)):
        inside = [a for a in group if id(a) in mine]
        if inside and len(inside) != len(group):
            raise NoMatch("a mask varies along only some of the batch, row or key axes")
        want.append(tuple(inside))
    return want




def _head_dims(m: AttnMatch) -> tuple[int, int]:
    """(q·k head dim, v head dim); they may differ only when both are static."""
    dq, dv = dim_size(tuple(m.depth)), dim_size(tuple(m.value_depth))
    if not same_size(dq, dv) and not (isinstance(dq, int) and isinstance(dv, int)):
        raise NoMatch("q·k and v head dims differ symbolically")
    return dq, dv


def _mask_input(graph: torch.fx.Graph, m: AttnMatch, dtype: torch.dtype) -> Node | None:
    """All masks as one additive mask [batch|1, 1, rows|1, keys|1] in the query's dtype."""
    total = None
    for term in m.masks:
        node = materialize(graph, term.node, term.dims, _mask_want(m, term))
        source = val(term.node).dtype
        if term.kind != "additive":
            values = (0.0, term.fill) if term.kind == "visible" else (term.fill, 0.0)
            node, source = graph.call_function(aten.where.Scalar, (node, *values)), torch.get_default_dtype()
        if source != dtype:
            node = graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})
        total = node if total is None else graph.call_function(aten.add.Tensor, (total, node))
    return total


def _pad(graph: torch.fx.Graph, node: Node, width: int) -> Node:
    return graph.call_function(aten.constant_pad_nd.default, (node, [0, width])) if width > 0 else node


def rewrite(gm: torch.fx.GraphModule, m: AttnMatch) -> None:
    graph, tracer = gm.graph, m.tracer
    dq, dv = _head_dims(m)
    width = max(dq, dv) if isinstance(dq, int) and isinstance(dv, int) else dq
    with graph.inserting_before(m.anchor):
        q = materialize(graph, m.q, tracer.leaf_dims[m.q], [tuple(m.batch), tuple(m.heads + m.groups),
                                                             tuple(m.rows), tuple(m.depth)])
        k = materialize(graph, m.k, tracer.leaf_dims[m.k], [tuple(m.batch), tuple(m.heads), tuple(m.keys),
                                                             tuple(m.depth)])
        v = materialize(graph, m.v, tracer.leaf_dims[m.v], [tuple(m.batch), tuple(m.heads), tuple(m.keys),
                                                             tuple(m.value_depth)])
        if width != dq:
            q, k = _pad(graph, q, width - dq), _pad(graph, k, width - dq)
        v = _pad(graph, v, width - dv if width != dv else 0)
        fused = graph.call_function(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, 0.0, False),
                                    {"attn_mask": _mask_input(graph, m, val(m.q).dtype), "scale": m.scale})
        out = graph.call_function(operator.getitem, (fused, 0))
        if width != dv:     # contiguous like the P·V product it replaces: later views of it must still apply
            out = graph.call_function(aten.slice.Tensor, (out, 3, 0, dv))
            out = graph.call_function(aten.clone.default, (out,), {"memory_format": torch.contiguous_format})
        out_dims = [tuple(m.batch), tuple(m.heads + m.groups), tuple(m.rows), tuple(m.value_depth)]
        result = materialize(graph, out, out_dims, tracer.trace(m.anchor).dims)
        if val(m.anchor).dtype != val(m.q).dtype:
            result = graph.call_function(aten._to_copy.default, (result,), {"dtype": val(m.anchor).dtype})
    m.anchor.replace_all_uses_with(result)


def _rewrite_or_undo(gm: torch.fx.GraphModule, m: AttnMatch) -> None:
    """Rewrite; if the layout cannot be built after all, remove what was inserted and re-raise."""
    existing = set(gm.graph.nodes)
    try:
        rewrite(gm, m)
    except (NoMatch, TraceError):
        for node in reversed(list(gm.graph.nodes)):
            if node not in existing:
                gm.graph.erase_node(node)
        raise


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    return fuse_matches(gm, {aten.bmm.default, aten.mm.default}, match, _rewrite_or_undo, PATTERN)

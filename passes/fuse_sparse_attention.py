"""fuse_sparse_attention: attention restricted to top-k key indices -> `ascend_dsa.sparse_flash_attention`.

MLA absorbed form (one latent KV head that is both key and value, optional shared RoPE key):
    out[b,t,h,:] = Σ_s softmax_s(c·(q[b,t,h]·K[b,s] + qr[b,t,h]·Kr[b,s]) + masks) · K[b,s]
Two ways models restrict it to the indexer's picks, both matched here (anchored on the P·V matmul):
- gather: K and Kr are rows gathered at the selected positions (paged: cache[table[sel // bs], sel % bs]),
  masked where `sel <= position` fails (decode: one query per sequence);
- mask: dense attention over the whole cache plus `full(-inf).scatter(-1, idx, 0)` and a causal mask
  (what transformers' eager path does); the causal part becomes lengths via `ascend_dsa.causal_lengths`.
Indices produced by fuse_lightning_indexer are passed through raw (int32, -1 padded).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.axis_trace import Axis, Expr, Tracer, as_leaf, flat, is_neg_inf, materialize, size_arg
from npu_graph.passes.fusion_graph import causal_lengths_from_mask, fuse_each, int32_table, leaf_root_ids
from npu_graph.passes.match_util import NoMatch, paged_read, strip_casts, val

NAME = "fuse_sparse_attention"
INFERENCE_ONLY = True
PATTERN_GATHER = "softmax(q·K[sel] + qr·Kr[sel]; sel <= pos) @ K[sel]"
PATTERN_MASK = "softmax(q·K + qr·Kr + scatter(-inf, idx, 0) + causal) @ K"

aten = torch.ops.aten
_VIEWS = {aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.squeeze.dim, aten.expand.default}


@dataclass
class Term:
    q: torch.fx.Node
    k: torch.fx.Node
    reduced: list[Axis]


@dataclass
class SparseMatch:
    pattern: str
    anchor: torch.fx.Node
    tracer: Tracer
    main: Term
    rope: Term | None
    scale: float
    keys: list[Axis]
    batch: list[Axis] = field(default_factory=list)
    rows: list[Axis] = field(default_factory=list)
    heads: list[Axis] = field(default_factory=list)
    indices: torch.fx.Node | None = None
    mask: torch.fx.Node | None = None
    position: torch.fx.Node | None = None


def _strip_views(node: object) -> object:
    while isinstance(node, torch.fx.Node) and (node.target in _VIEWS or node.target in
                                               (aten._to_copy.default, aten.clone.default)):
        node = node.args[0]
    return node


def _terms(tracer: Tracer, score: Expr, keys: list[Axis]) -> tuple[list[Term], float]:
    """The q·k contractions summed in the score, and the score's overall scale."""
    scale = 1.0
    while score.kind == "masked":
        scale *= score.scale
        score = score.factors[0]
    scale *= score.scale
    parts = list(score.factors) if score.kind == "add" else [score]
    terms, term_scales = [], set()
    for part in parts:
        if part.kind != "matmul" or len(part.factors) != 2:
            raise NoMatch("a score term is not one q·k product")
        a, b = (as_leaf(tracer, f) for f in part.factors)
        key_ids = {id(x) for x in flat(keys)}
        q, k = (b, a) if key_ids <= leaf_root_ids(tracer, a.node) else (a, b)
        if not key_ids <= leaf_root_ids(tracer, k.node):
            raise NoMatch("a score term does not run over the softmax axis")
        reduced = {id(a) for a in flat(list(part.reduced))}
        ordered = [a for d in tracer.leaf_dims[k.node] for a in flat(d) if id(a) in reduced]
        terms.append(Term(q.node, k.node, ordered))
        term_scales.add(part.scale)
    if len(term_scales) != 1:
        raise NoMatch("score terms carry different scales")
    return terms, scale * term_scales.pop()


def _softmax_parts(tracer: Tracer, anchor: torch.fx.Node) -> tuple[Expr, Expr, torch.fx.Node]:
    """(softmax expr, value leaf, the softmax node) of a P·V matmul."""
    expr = tracer.trace(anchor).expr
    if expr.kind != "matmul" or len(expr.factors) != 2:
        raise NoMatch("not a matmul", near=False)
    softmaxes = [f for f in expr.factors if f.kind == "softmax"]
    others = [f for f in expr.factors if f.kind != "softmax"]
    reduced = {id(a) for a in flat(list(expr.reduced))}
    if len(softmaxes) != 1 or not others or not {id(a) for a in flat(softmaxes[0].axes)} <= reduced:
        raise NoMatch("not softmax(...) @ V over the softmax axis", near=False)
    return softmaxes[0], as_leaf(tracer, others[0]), softmaxes[0].node


def _split_score_and_mask(tracer: Tracer, softmax: Expr) -> tuple[Expr, torch.fx.Node | None]:
    """The score expression and, for `score + mask`, the additive mask node."""
    inner = softmax.factors[0]
    if inner.kind == "add" and len(inner.factors) == 2:
        kinds = [_has_matmul(f) for f in inner.factors]
        if kinds.count(True) == 1:
            score = inner.factors[kinds.index(True)]
            other = inner.node.args[1 - kinds.index(True)]
            return score, other
    return inner, None


def _has_matmul(expr: Expr) -> bool:
    return expr.kind == "matmul" or any(_has_matmul(f) for f in expr.factors)


def _sparse_evidence(value: Expr, additive: torch.fx.Node | None) -> bool:
    """Does this attention select keys by index (gathered rows, or a scatter-built mask)?"""
    if _paged_gather(value.node) is not None:
        return True
    mask = _strip_views(additive) if additive is not None else None
    parts = [] if mask is None else [mask] if mask.target != aten.add.Tensor else list(mask.args[:2])
    return any(_strip_views(p).target == aten.scatter.value for p in parts if isinstance(p, torch.fx.Node))


def match(anchor: torch.fx.Node) -> SparseMatch:
    tracer = Tracer()
    softmax, value, softmax_node = _softmax_parts(tracer, anchor)
    keys = list(flat(softmax.axes))
    score, additive = _split_score_and_mask(tracer, softmax)
    try:
        terms, scale = _terms(tracer, score, keys)
        main = [t for t in terms if t.k is value.node]
        if len(main) != 1 or len(terms) > 2:
            raise NoMatch("the value is not the key of one score term (MLA absorbed form)")
        rope = next((t for t in terms if t is not main[0]), None)
        m = SparseMatch(PATTERN_MASK if additive is not None else PATTERN_GATHER, anchor, tracer, main[0], rope,
                        scale, keys)
        if additive is not None:
            _read_mask_form(m, additive)
            _assign_query_axes(m, softmax_node, list(val(additive).shape))
        else:
            _read_gather_form(m, score)
            _assign_query_axes(m, softmax_node, None)
    except NoMatch as exc:
        exc.near = exc.near and _sparse_evidence(value, additive)
        raise
    return m


def _read_mask_form(m: SparseMatch, additive: torch.fx.Node) -> None:
    mask = _strip_views(additive)
    parts = [mask] if mask.target != aten.add.Tensor else [_strip_views(a) for a in mask.args[:2]]
    scatters = [p for p in parts if p.target == aten.scatter.value and p.args[1] in (-1, val(p).dim() - 1)
                and _is_zero(p.args[3]) and is_neg_inf(p.args[0])]
    if len(scatters) != 1:
        raise NoMatch("the mask is not built from top-k indices (scatter of 0 into -inf)", near=False)
    m.indices = scatters[0].args[2]
    causal = [p for p in parts if p is not scatters[0]]
    m.mask = causal[0] if causal else None
    if len(causal) > 1:
        raise NoMatch("more than one extra mask")


def _is_zero(value: object) -> bool:
    return isinstance(value, (int, float)) and value == 0


def _read_gather_form(m: SparseMatch, score: Expr) -> None:
    if score.kind != "masked":
        raise NoMatch("gathered rows without a position mask")
    gathered = _paged_gather(m.main.k)
    if gathered is None:
        raise NoMatch("keys are not rows gathered from a paged cache")
    invisible = _strip_views(score.node.args[1])
    visible = _strip_views(invisible.args[0]) if invisible.target in (aten.bitwise_not.default,
                                                                     aten.logical_not.default) else None
    if visible is None or visible.target != aten.le.Tensor or strip_casts(visible.args[0]) is not gathered[2]:
        raise NoMatch("the mask is not `selected <= position`")
    m.indices, m.position = gathered[2], visible.args[1]


def _paged_gather(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(cache, block_table, selected positions) for cache[table.gather(1, sel // bs), sel % bs]."""
    if node.target != aten.index.Tensor or len(node.args[1]) != 2:
        return None
    blocks, offsets = node.args[1]
    if getattr(blocks, "target", None) != aten.gather.default or getattr(offsets, "target", None) != \
            aten.remainder.Scalar:
        return None
    block = val(node.args[0]).shape[1]
    division = blocks.args[2]
    if division.target != aten.floor_divide.default or division.args[1] != block or offsets.args[1] != block:
        return None
    selected = offsets.args[0]
    if division.args[0] is not selected:
        return None
    return node.args[0], blocks.args[0], selected


def _assign_query_axes(m: SparseMatch, softmax_node: torch.fx.Node, mask_shape: list | None) -> None:
    """Split the query-side axes into batch, rows (positions: the mask varies along them) and heads."""
    tracer = m.tracer
    rq, rk = leaf_root_ids(tracer, m.main.q), leaf_root_ids(tracer, m.main.k)
    dims = tracer.trace(softmax_node).dims
    shape = [1] * len(dims) if mask_shape is None else [1] * (len(dims) - len(mask_shape)) + mask_shape
    key_ids = {id(a) for a in m.keys}
    for dim, size in zip(dims, shape):
        for a in flat(dim):
            root = id(a)
            if root in key_ids:
                continue
            if root in rq and root in rk:
                m.batch.append(a)
            elif root in rq:
                (m.heads if isinstance(size, int) and size == 1 else m.rows).append(a)
            else:
                raise NoMatch("an attention axis belongs to neither query nor keys")


def _kv_input(graph: torch.fx.Graph, m: SparseMatch, term: Term) -> tuple[torch.fx.Node, torch.fx.Node | None, str]:
    """Key tensor as the op takes it: the paged cache itself, or a [B,S,1,D] layout of the keys."""
    gathered = _paged_gather(term.k)
    paged = gathered or paged_read(term.k)
    if paged is not None:
        return paged[0], int32_table(graph, paged[1]), "PA_BSND"
    dims = m.tracer.leaf_dims[term.k]
    key = materialize(graph, term.k, dims, [tuple(m.batch), tuple(m.keys), (), tuple(term.reduced)])
    return key, None, "BSND"


def _sparse_indices(graph: torch.fx.Graph, m: SparseMatch) -> torch.fx.Node:
    """[B, S1, 1, K] int32 indices; the raw (-1 padded) indexer output when the indices came from it."""
    source = _strip_views(m.indices)
    while isinstance(source, torch.fx.Node) and source.target == aten.select.int:
        source = _strip_views(source.args[0])
    raw = source.meta.get("ascend_dsa_indexer") if isinstance(source, torch.fx.Node) else None
    if raw is not None:
        return graph.call_function(operator.getitem, (raw, 0))
    count = val(m.indices).shape[-1]
    if not isinstance(count, int):
        count = graph.call_function(aten.sym_size.int, (m.indices, val(m.indices).dim() - 1))
    indices = graph.call_function(aten._to_copy.default, (m.indices,), {"dtype": torch.int32})
    shape = [size_arg(graph, m.batch), size_arg(graph, m.rows), 1, count]
    return graph.call_function(aten.reshape.default, (indices, shape))


def _lengths(graph: torch.fx.Graph, m: SparseMatch) -> tuple[object, object]:
    if m.position is not None:
        position = graph.call_function(aten.reshape.default, (m.position, [size_arg(graph, m.batch)]))
        position = graph.call_function(aten.add.Tensor, (position, 1))
        return None, graph.call_function(aten._to_copy.default, (position,), {"dtype": torch.int32})
    if m.mask is None:
        return None, None
    shape = [size_arg(graph, m.batch), size_arg(graph, m.rows), size_arg(graph, m.keys)]
    return causal_lengths_from_mask(graph, m.mask, shape, shape, "additive")


def rewrite(gm: torch.fx.GraphModule, m: SparseMatch) -> None:
    graph, tracer = gm.graph, m.tracer
    with graph.inserting_before(m.anchor):
        q = materialize(graph, m.main.q, tracer.leaf_dims[m.main.q],
                        [tuple(m.batch), tuple(m.rows), tuple(m.heads), tuple(m.main.reduced)])
        key, table, layout = _kv_input(graph, m, m.main)
        q_rope = k_rope = None
        if m.rope is not None:
            q_rope = materialize(graph, m.rope.q, tracer.leaf_dims[m.rope.q],
                                 [tuple(m.batch), tuple(m.rows), tuple(m.heads), tuple(m.rope.reduced)])
            k_rope, rope_table, rope_layout = _kv_input(graph, m, m.rope)
            if rope_layout != layout or strip_casts(rope_table) is not strip_casts(table):
                raise NoMatch("key and rope key use different layouts or block tables")
        lengths_q, lengths_kv = _lengths(graph, m)
        fused = graph.call_function(
            torch.ops.ascend_dsa.sparse_flash_attention.default,
            (q, key, key, _sparse_indices(graph, m), m.scale, table, lengths_q, lengths_kv, q_rope, k_rope),
            {"layout_kv": layout, "sparse_mode": 3})
        out = graph.call_function(operator.getitem, (fused, 0))
        out_dims = [tuple(m.batch), tuple(m.rows), tuple(m.heads), tuple(m.main.reduced)]
        result = materialize(graph, out, out_dims, tracer.trace(m.anchor).dims)
        if val(m.anchor).dtype != val(m.main.q).dtype:
            result = graph.call_function(aten._to_copy.default, (result,), {"dtype": val(m.anchor).dtype})
    m.anchor.replace_all_uses_with(result)


def _fuse(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    found = match(node)
    rewrite(gm, found)
    return found.pattern


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    return fuse_each(gm, {aten.bmm.default, aten.mm.default}, lambda node: _fuse(node, gm), "sparse attention")

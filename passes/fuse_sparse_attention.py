"""fuse_sparse_attention: attention restricted to top-k key indices -> `ascend_dsa.sparse_flash_attention`.

MLA absorbed form (one latent KV head that is both key and value, optional shared RoPE key):
    out[b,t,h,:] = Σ_s softmax_s(c·(q[b,t,h]·K[b,s] + qr[b,t,h]·Kr[b,s]) + masks) · K[b,s]
Two ways models restrict it to the indexer's picks, both matched here (anchored on the P·V matmul):
- gather: K and Kr are rows gathered at the selected positions (paged: cache[table[sel // bs], sel % bs]),
  masked where `sel <= position` fails (one query per batch row: a decode step, or a step of a few tokens whose
  rows become batch rows, [B, T·K] gathered rows viewed as [B, T, K] or [B·T, K]: each such row then reads its
  sequence's block table, and its own position bounds its keys, so no mask is as wide as the cache);
- mask: dense attention over the whole cache plus a mask built from the indices (the forms sparse_mask reads:
  `full(-inf).scatter(-1, idx, 0)`, transformers' boolean and masked_fill forms) and a causal mask; the causal
  part becomes lengths via `ascend_dsa.causal_lengths`. transformers' non-absorbed MLA reaches this form
  through absorb_mla.
Indices produced by fuse_lightning_indexer are passed through raw (int32, -1 padded).
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from npu_graph.pass_api import MetaKey, PassContext, PassResult
from npu_graph.passes.matching.attention_parts import Term, score_terms, softmax_parts, split_score_and_mask
from npu_graph.passes.matching.axis_trace import Axis, Expr, Tracer, flat
from npu_graph.passes.matching.fusion_graph import (
    causal_lengths_from_mask,
    dim_arg,
    fuse_each,
    int32_table,
    leaf_root_ids,
)
from npu_graph.passes.matching.match_util import NoMatch, paged_read
from npu_graph.passes.matching.materialize import materialize, size_arg
from npu_graph.passes.matching.sparse_mask import is_sparse_mask, read_sparse_mask
from npu_graph.passes.matching.values import NEGATIONS, VIEWS_AND_CASTS, same_size, strip_casts, strip_views, val

NAME = "fuse_sparse_attention"
INFERENCE_ONLY = True
PATTERN_GATHER = "softmax(q·K[sel] + qr·Kr[sel]; sel <= pos) @ K[sel]"
PATTERN_MASK = "softmax(q·K + qr·Kr + mask(top-k idx) + causal) @ K"

aten = torch.ops.aten


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
    mask_kind: str = "additive"
    head_dims: list[int] = field(default_factory=list)   # the attention's dims made only of head axes (from the right)


def _sparse_evidence(value: Expr, additive: torch.fx.Node | None) -> bool:
    """Does this attention select keys by index (gathered rows, or an index-built mask)?"""
    return _paged_gather(value.node) is not None or is_sparse_mask(additive)


def match(anchor: torch.fx.Node) -> SparseMatch:
    tracer = Tracer()
    parts = softmax_parts(tracer, anchor)
    score, additive = split_score_and_mask(parts.score)
    try:
        terms, scale = score_terms(tracer, score, parts.keys)
        main = [t for t in terms if t.k is parts.value.node]
        if len(main) != 1 or len(terms) > 2:
            raise NoMatch("the value is not the key of one score term (MLA absorbed form)",
                          differs=f"values {parts.value.node.name} beside score keys "
                                  f"{', '.join(t.k.name for t in terms)} where the pattern has the latent key")
        rope = next((t for t in terms if t is not main[0]), None)
        m = SparseMatch(PATTERN_MASK if additive is not None else PATTERN_GATHER, anchor, tracer, main[0], rope,
                        scale, parts.keys)
        if additive is not None:
            sparse = read_sparse_mask(additive)
            m.indices, m.mask, m.mask_kind = sparse.indices, sparse.causal, sparse.causal_kind
            _assign_query_axes(m, parts.softmax, list(val(additive).shape))
        else:
            _read_gather_form(m, score)
            _assign_query_axes(m, parts.softmax, None)
            if _fold(m) is None:
                raise NoMatch("the gathered rows are viewed as rows that straddle two sequences")
    except NoMatch as exc:
        exc.near = exc.near and _sparse_evidence(parts.value, additive)
        raise
    return m


def _read_gather_form(m: SparseMatch, score: Expr) -> None:
    if score.kind != "masked":
        raise NoMatch("gathered rows without a position mask")
    gathered = _paged_gather(m.main.k)
    if gathered is None:
        raise NoMatch("keys are not rows gathered from a paged cache")

    invisible = strip_views(score.node.args[1])
    visible = strip_views(invisible.args[0]) if invisible.target in NEGATIONS else None
    if visible is None or visible.target != aten.le.Tensor or \
            strip_views(visible.args[0]) is not strip_views(gathered[2]):
        raise NoMatch("the mask is not `selected <= position`")
    m.indices, m.position = visible.args[0], visible.args[1]     # the selection as the attention's rows see it


def _paged_gather(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(cache, block_table, selected positions) for cache[table.gather(1, sel // bs), sel % bs], read through
    views."""
    node = strip_views(node)
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


def _fold(m: SparseMatch) -> object | None:
    """How many of the attention's batch rows each sequence's gathered rows `[B, N, 1, D]` make: F when the
    attention reads them as B·F rows of N/F keys (each row within one sequence), 1 without folding, else None."""
    gathered = strip_views(m.main.k)
    sequences, count = val(gathered).shape[:2]
    rows, per_row = (functools.reduce(operator.mul, (a.size for a in axes), 1) for axes in (m.batch, m.keys))
    if same_size(rows, sequences):
        return 1
    if not same_size(count % per_row, 0) or not same_size(rows * per_row, sequences * count):
        return None
    return count // per_row


def _assign_query_axes(m: SparseMatch, softmax_node: torch.fx.Node, mask_shape: list | None) -> None:
    """Split the query-side axes into batch, rows (positions: the mask varies along them) and heads."""
    tracer = m.tracer
    rq, rk = leaf_root_ids(tracer, m.main.q), leaf_root_ids(tracer, m.main.k)
    dims = tracer.trace(softmax_node).dims
    shape = [1] * len(dims) if mask_shape is None else [1] * (len(dims) - len(mask_shape)) + mask_shape
    key_ids = {id(a) for a in m.keys}
    for i, (dim, size) in enumerate(zip(dims, shape)):
        heads_before = len(m.heads)
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
        if flat(dim) and len(m.heads) - heads_before == len(flat(dim)):
            m.head_dims.append(i - len(dims))


def _kv_input(graph: torch.fx.Graph, m: SparseMatch, term: Term) -> tuple[torch.fx.Node, torch.fx.Node | None, str]:
    """Key tensor as the op takes it: the paged cache itself, or a [B,S,1,D] layout of the keys."""
    gathered = _paged_gather(term.k)
    paged = gathered or paged_read(term.k)
    if paged is not None:
        return paged[0], int32_table(graph, paged[1]), "PA_BSND"
    dims = m.tracer.leaf_dims[term.k]
    key = materialize(graph, term.k, dims, [tuple(m.batch), tuple(m.keys), (), tuple(term.reduced)])
    return key, None, "BSND"


def _indexer_output(indices: torch.fx.Node) -> torch.fx.Node | None:
    """The lightning_indexer node whose (-1 replaced) indices reach `indices` through views, casts and
    selects; the replaced indices may repeat a key, so the fused op must take the raw ones."""
    node = indices
    while isinstance(node, torch.fx.Node):
        if "ascend_dsa_indexer" in node.meta:
            return node.meta[MetaKey.FUSED_INDEXER]
        if node.target not in VIEWS_AND_CASTS and node.target != aten.select.int:
            return None
        node = node.args[0]
    return None


def _sparse_indices(graph: torch.fx.Graph, m: SparseMatch) -> torch.fx.Node:
    """[B, S1, 1, K] int32 indices; the raw (-1 padded) indexer output when the indices came from it (its rows
    folded into the batch as the attention's are)."""
    raw = _indexer_output(m.indices)
    if raw is not None:
        indices = graph.call_function(operator.getitem, (raw, 0))
        shape = [size_arg(graph, m.batch), size_arg(graph, m.rows), 1, -1]
        return graph.call_function(aten.reshape.default, (indices, shape))
    count = dim_arg(graph, m.indices, val(m.indices).dim() - 1)
    indices = graph.call_function(aten._to_copy.default, (m.indices,), {"dtype": torch.int32})
    shape = [size_arg(graph, m.batch), size_arg(graph, m.rows), 1, count]
    return graph.call_function(aten.reshape.default, (indices, shape))


def _folded_table(graph: torch.fx.Graph, m: SparseMatch, table: torch.fx.Node | None) -> torch.fx.Node | None:
    """The block table with each sequence's row repeated for the batch rows its tokens were folded into."""
    fold = _fold(m) if table is not None and _paged_gather(m.main.k) is not None else 1
    if isinstance(fold, int) and fold == 1:
        return table
    sequences, blocks = dim_arg(graph, table, 0), dim_arg(graph, table, 1)
    folds = size_arg(graph, m.batch) if isinstance(sequences, int) and sequences == 1 else \
        graph.call_function(operator.floordiv, (size_arg(graph, m.batch), sequences))
    per_sequence = graph.call_function(aten.unsqueeze.default, (table, 1))
    expanded = graph.call_function(aten.expand.default, (per_sequence, [sequences, folds, blocks]))
    return graph.call_function(aten.reshape.default, (expanded, [size_arg(graph, m.batch), blocks]))


def _lengths(graph: torch.fx.Graph, m: SparseMatch, windows: bool) -> tuple[object, object, object]:
    if m.position is not None:
        position = graph.call_function(aten.reshape.default, (m.position, [size_arg(graph, m.batch)]))
        position = graph.call_function(aten.add.Tensor, (position, 1))
        return None, graph.call_function(aten._to_copy.default, (position,), {"dtype": torch.int32}), None
    if m.mask is None:
        return None, None, None
    shape = [size_arg(graph, m.batch), size_arg(graph, m.rows), size_arg(graph, m.keys)]
    rank = val(m.mask).dim()
    heads = [rank + i for i in m.head_dims if rank + i >= 0 and val(m.mask).shape[rank + i] == 1]
    return causal_lengths_from_mask(graph, m.mask, shape, shape, m.mask_kind, heads, windows)


def rewrite(gm: torch.fx.GraphModule, m: SparseMatch, windows: bool = False) -> None:
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
        lengths_q, lengths_kv, starts = _lengths(graph, m, windows)
        table = _folded_table(graph, m, table)
        fused = graph.call_function(
            torch.ops.ascend_dsa.sparse_flash_attention.default,
            (q, key, key, _sparse_indices(graph, m), m.scale, table, lengths_q, lengths_kv, q_rope, k_rope, None,
             None, starts),
            {"layout_kv": layout, "sparse_mode": 3})
        out = graph.call_function(operator.getitem, (fused, 0))
        out_dims = [tuple(m.batch), tuple(m.rows), tuple(m.heads), tuple(m.main.reduced)]
        result = materialize(graph, out, out_dims, tracer.trace(m.anchor).dims)
        if val(m.anchor).dtype != val(m.main.q).dtype:
            result = graph.call_function(aten._to_copy.default, (result,), {"dtype": val(m.anchor).dtype})
    m.anchor.replace_all_uses_with(result)


def _fuse(node: torch.fx.Node, gm: torch.fx.GraphModule, windows: bool) -> str:
    found = match(node)
    rewrite(gm, found, windows)
    return found.pattern


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    windows = ctx.machine.dsa_key_starts
    return fuse_each(gm, {aten.bmm.default, aten.mm.default}, lambda node: _fuse(node, gm, windows),
                     "sparse attention")

"""absorb_mla: top-k sparse MLA attention written in expanded form -> the absorbed form sparse attention runs.

transformers' DeepSeek-V3.2 (like most MLA code) expands the compressed latent L into per-head keys and values
with `kv_b_proj` and attends over them with a mask built from the indexer's top-k:
    k[h,s] = [L[s]·Wk[h]ᵀ | kr[s]],  v[h,s] = L[s]·Wv[h]ᵀ,  q[h,t] = [qn[h,t] | qr[h,t]]
    out[h,t] = Σ_s softmax_s(c·q[h,t]·k[h,s] + mask) v[h,s]
Weight absorption rewrites it exactly (up to float rounding) over the one latent head:
    out[h,t] = (Σ_s softmax_s(c·((qn[h,t]·Wk[h])·L[s] + qr[h,t]·kr[s]) + mask) L[s]) · Wv[h]ᵀ
which is what fuse_sparse_attention turns into `sparse_flash_attention` (and what DeepSeek's own sparse kernel
computes). Index-restricted attention is always rewritten. Dense attention (no mask, or an additive one) is
rewritten where the absorbed form costs less: per key and head, the expanded form projects the latent
(L·(nope+dv) multiply-adds) and the absorbed one attends over it with every query row (S1·(2L+R)), so a decode
step (S1 = 1, Kimi Linear's MLA layers: ~200x fewer) is absorbed and a prefill (S1 = S2) is not.
The per-head weight slices read only parameters, so the hoisting prologue computes them once.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.canonical.reading import transposed
from npu_graph.passes.matching.attention_parts import score_terms, softmax_parts, split_score_and_mask
from npu_graph.passes.matching.axis_trace import Dim, Tracer, flat
from npu_graph.passes.matching.fusion_graph import dim_arg, fuse_matches
from npu_graph.passes.matching.match_util import NoMatch
from npu_graph.passes.matching.materialize import materialize
from npu_graph.passes.matching.sparse_mask import is_sparse_mask
from npu_graph.passes.matching.values import RESHAPES, arg, is_last_dim, same_size, val

NAME = "absorb_mla"
INFERENCE_ONLY = True
PATTERN = "softmax(c·[qn|qr]·[L·Wkᵀ|kr] + top-k mask) @ L·Wvᵀ"

aten = torch.ops.aten
_EMPTY = {aten.new_empty.default, aten.empty.memory_format, aten.empty_like.default, aten.new_zeros.default,
          aten.zeros.default}

_LAYOUT = RESHAPES | {aten.transpose.int, aten.permute.default, aten.clone.default, aten.expand.default}
_SCALES = {aten.mul.Scalar, aten.mul.Tensor, aten.div.Scalar, aten.div.Tensor}
_DIVISIONS = {aten.div.Scalar, aten.div.Tensor}


@dataclass
class MLAMatch:
    anchor: torch.fx.Node
    tracer: Tracer
    softmax: torch.fx.Node
    mask: torch.fx.Node | None
    scale: float
    q_nope: torch.fx.Node | tuple  # a node, or (query, start, end) for a slice to emit
    q_rope: torch.fx.Node | tuple
    latent: torch.fx.Node
    k_rope: torch.fx.Node
    weight: torch.fx.Node
    nope: int
    out_dims: list[Dim]


def concat_last(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The pieces of a tensor built by concatenating along its last dim (`cat`, or slice_scatter writes into
    an empty tensor covering it exactly), in order."""
    rank = val(node).dim()
    if node.target == aten.cat.default and is_last_dim(arg(node, 1, 0), rank):
        return list(node.args[0])
    pieces, width = [], val(node).shape[-1]
    while node.target == aten.slice_scatter.default:
        base, src, dim, start, end = [*node.args, 0, None, None][:5]
        if not is_last_dim(dim, rank) or arg(node, 5, 1) != 1:
            raise NoMatch("a slice write that is not along the last dim")
        if src.target == aten.copy.default:
            src = src.args[1]
        pieces.append((start or 0, min(end if end is not None else sys.maxsize, width), src))
        node = base
    if node.target not in _EMPTY:
        raise NoMatch("not a concatenation along the last dim")
    pieces.sort(key=lambda p: p[0])
    bounds = [0] + [p[1] for p in pieces]
    if [p[0] for p in pieces] != bounds[:-1] or bounds[-1] != width:
        raise NoMatch("slice writes do not cover the tensor exactly once")
    return [p[2] for p in pieces]


def _split_source(part: torch.fx.Node) -> tuple[torch.fx.Node, int, int]:
    """(source, start, end) of a last-dim piece: getitem of split_with_sizes, or slice."""
    if part.target == aten.slice.Tensor and is_last_dim(part.args[1], val(part.args[0]).dim()):
        width = val(part.args[0]).shape[-1]
        return part.args[0], part.args[2], min(part.args[3], width)
    source = part.args[0] if part.target.__name__ == "getitem" else None
    if source is None or source.target != aten.split_with_sizes.default or not is_last_dim(source.args[2], 4):
        raise NoMatch("key and value are not pieces of one per-head projection")
    sizes = source.args[1]
    start = sum(sizes[:part.args[1]])
    return source.args[0], start, start + sizes[part.args[1]]


def head_projection(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, int, int]:
    """(latent, weight [H·E, C], H, E) when `node` [B, H, S, E] is `(latent @ weightᵀ).view(B, S, H, E)
    .transpose(1, 2)` (an nn.Linear without bias, viewed per head)."""
    if not _swaps_heads(node):
        raise NoMatch("the key/value projection is not laid out as [B, heads, S, dim]")
    per_head = node.args[0]
    heads, width = val(per_head).shape[2:]
    product = per_head
    while product.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        product = product.args[0]
    if product.target != aten.mm.default or transposed(product.args[1]) is None:
        raise NoMatch("the key/value projection is not a bias-free linear layer")
    latent, weight = product.args[0], transposed(product.args[1])
    while latent.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        latent = latent.args[0]
    lead, rows = _non_unit(val(latent).shape[:-1]), _non_unit(val(per_head).shape[:2])
    if len(lead) != len(rows) or not all(map(same_size, lead, rows)) or val(weight).shape[0] != heads * width:
        raise NoMatch("the projection's rows are not the latent's (batch, position) rows")
    return latent, weight, heads, width


def _swaps_heads(node: torch.fx.Node) -> bool:
    """`node` is [B, S, H, E] -> [B, H, S, E] (transpose(1, 2) or the permute)."""
    return (node.target == aten.transpose.int and sorted(d % 4 for d in node.args[1:3]) == [1, 2]) or \
        (node.target == aten.permute.default and [d % 4 for d in node.args[1]] == [0, 2, 1, 3])


def _non_unit(shape: object) -> list[object]:
    return [s for s in shape if not (isinstance(s, int) and s == 1)]


def match(anchor: torch.fx.Node) -> MLAMatch:
    """MLA attention at `anchor`; dense attention that is not MLA's (most dense attention) is no near miss."""
    tracer = Tracer()
    parts = softmax_parts(tracer, anchor)
    score, mask = split_score_and_mask(parts.score)
    dense = not is_sparse_mask(mask)
    if dense and score.kind == "masked":
        raise NoMatch("dense attention with a masked fill", near=False)
    try:
        return _match_parts(anchor, tracer, parts, score, mask, dense)
    except NoMatch as exc:
        if dense and exc.near:
            raise NoMatch(str(exc), near=False) from exc
        raise


def _match_parts(anchor: torch.fx.Node, tracer: Tracer, parts: Any, score: Any, mask: Any, dense: bool) -> MLAMatch:
    terms, scale = score_terms(tracer, score, parts.keys)
    if len(terms) != 1:
        raise NoMatch("the score is not one q·k product (already absorbed?)", near=False)
    (q_cat, q_scale), (k_cat, k_scale) = _query_operand(terms[0]), _underlying(terms[0].k)
    scale *= q_scale * k_scale
    for node in (q_cat, k_cat):
        if {id(a) for a in flat(tracer.trace(node).dims[-1])} != {id(a) for a in terms[0].reduced}:
            raise NoMatch("q·k does not contract the last dim")
    k_nope, k_rope = _two_pieces(k_cat)
    q_nope, q_rope = _query_pieces(q_cat, val(k_nope).shape[-1])
    source, start, end = _split_source(k_nope)
    value_source, v_start, v_end = _split_source(parts.value.node)
    latent, weight, _, width = head_projection(source)
    nope = val(k_nope).shape[-1]
    if value_source is not source or (start, end, v_start, v_end) != (0, nope, nope, width):
        raise NoMatch("keys and values are not the two halves of one per-head projection")
    if k_rope.target == aten.expand.default:
        k_rope = k_rope.args[0]
    if val(k_rope).dim() != 4 or val(k_rope).shape[1] != 1:
        raise NoMatch("the rope key is not shared by the heads",
                      differs=f"a rope key of shape {list(val(k_rope).shape)} where the pattern has one head "
                              "[B, 1, S, R]")
    if dense and not _absorbing_pays(q_cat, latent, k_rope, weight, nope):
        raise NoMatch("dense attention over as many query rows as the expanded form costs", near=False)
    q_dims, v_dims = tracer.trace(q_cat).dims, tracer.leaf_dims[parts.value.node]
    out_dims = [tuple(flat(q_dims[0])), tuple(flat(q_dims[1])), tuple(flat(q_dims[2])), tuple(flat(v_dims[3]))]
    return MLAMatch(anchor, tracer, parts.softmax, mask, scale, q_nope, q_rope, latent, k_rope, weight, nope,
                    out_dims)


def _absorbing_pays(query: torch.fx.Node, latent: torch.fx.Node, k_rope: torch.fx.Node, weight: torch.fx.Node,
                    nope: int) -> bool:
    """Dense attention: whether the absorbed form costs less per key and head (module docstring); a symbolic
    number of query rows is not known to."""
    rows, heads = val(query).shape[2], val(query).shape[1]
    latent_dim, rope_dim = val(latent).shape[-1], val(k_rope).shape[-1]
    value_dim = val(weight).shape[0] // heads - nope
    return isinstance(rows, int) and rows * (2 * latent_dim + rope_dim) < latent_dim * (nope + value_dim)


def _underlying(leaf: torch.fx.Node, at_heads: bool = False) -> tuple[torch.fx.Node, float]:
    """The tensor under a score factor's scalar scales and layout changes, and the product of the scales
    (the tracer folded them into the leaf; absorption reads the pieces below them). `at_heads` (the query)
    stops at a [B, S, H, E] -> [B, H, S, E] transpose: below it is a whole projection (Kimi Linear's query, no
    [nope | rope] concatenation), which the rewrite takes sliced in the [B, H, S, E] layout."""
    node, scale = leaf, 1.0
    while (node.target in _LAYOUT or node.target in _SCALES) and not (at_heads and _swaps_heads(node)):
        if node.target in _SCALES:
            if not isinstance(node.args[1], (int, float)):
                break
            scale *= node.args[1] if node.target not in _DIVISIONS else 1.0 / node.args[1]
        node = node.args[0]
    return node, scale


def _query_operand(term: Any) -> tuple[torch.fx.Node, float]:
    """The query [B, H, S, E] under the q·k product's query operand (the tracer's leaf may lie deeper: a
    projection viewed as heads traces through to the projection), and its scale."""
    product = term.product
    while isinstance(product, torch.fx.Node) and (product.target in _SCALES or product.target in RESHAPES) \
            and not isinstance(product.args[1] if len(product.args) > 1 else None, torch.fx.Node):
        product = product.args[0]   # the product node's value may carry the score's scale
    operands = [a for a in getattr(product, "args", ())[:2] if isinstance(a, torch.fx.Node)]
    under = [_underlying(a, at_heads=True) for a in operands]
    keyed = [u for u in under if u[0] is _underlying(term.k)[0]]
    if product is None or product.target not in (aten.bmm.default, aten.mm.default) or len(keyed) != 1:
        return _underlying(term.q, at_heads=True)
    return next(u for u in under if u is not keyed[0])


def _query_pieces(query: torch.fx.Node, nope: int) -> tuple[torch.fx.Node | tuple, torch.fx.Node | tuple]:
    """[nope | rope] pieces of the query: its concatenated parts, or slices (to emit) of a whole query."""
    try:
        pieces = _two_pieces(query)
    except NoMatch:
        return (query, 0, nope), (query, nope, val(query).shape[-1])
    if val(pieces[0]).shape[-1] != nope:
        raise NoMatch("query and key split their head dim differently")
    return pieces[0], pieces[1]


def _piece(graph: torch.fx.Graph, piece: torch.fx.Node | tuple) -> torch.fx.Node:
    if isinstance(piece, torch.fx.Node):
        return piece
    return graph.call_function(aten.slice.Tensor, (piece[0], -1, piece[1], piece[2]))


def _two_pieces(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    pieces = concat_last(node)
    if len(pieces) != 2 or val(node).dim() != 4:
        raise NoMatch("query/key is not [nope | rope] over [B, heads, S, dim]")
    return pieces[0], pieces[1]


def _call(graph: torch.fx.Graph, target: object, *args: object) -> torch.fx.Node:
    return graph.call_function(target, args)


def _per_head_matmul(graph: torch.fx.Graph, x: torch.fx.Node, weights: torch.fx.Node, sizes: tuple) -> torch.fx.Node:
    """[B, H, T, a] x [H, a, b] -> [B, H, T, b] as one batched matmul over the heads; sizes (B, H, T, a, b)."""
    batch, heads, rows, width, out_width = sizes
    flat_x = _call(graph, aten.reshape.default, _call(graph, aten.permute.default, x, [1, 0, 2, 3]),
                   [heads, -1, width])
    product = _call(graph, aten.bmm.default, flat_x, weights)
    product = _call(graph, aten.reshape.default, product, [heads, batch, rows, out_width])
    return _call(graph, aten.permute.default, product, [1, 0, 2, 3])


def _scores(graph: torch.fx.Graph, q: torch.fx.Node, keys: torch.fx.Node, batch: object, width: int
            ) -> torch.fx.Node:
    """[B, H, T, d] · [B, S, d] -> [B, H·T, S]."""
    q_rows = _call(graph, aten.reshape.default, q, [batch, -1, width])
    return _call(graph, aten.bmm.default, q_rows, _call(graph, aten.transpose.int, keys, 1, 2))


def rewrite(gm: torch.fx.GraphModule, m: MLAMatch) -> None:
    graph = gm.graph
    latent_dim, rope_dim = val(m.latent).shape[-1], val(m.k_rope).shape[-1]
    with graph.inserting_before(m.anchor):
        q_nope, q_rope = _piece(graph, m.q_nope), _piece(graph, m.q_rope)
        query = m.q_rope[0] if isinstance(m.q_rope, tuple) else m.q_rope
        heads = val(query).shape[1]
        value_dim = val(m.weight).shape[0] // heads - m.nope
        batch, rows = dim_arg(graph, query, 0), dim_arg(graph, query, 2)
        keys = dim_arg(graph, m.latent, val(m.latent).dim() - 2)
        weight = _call(graph, aten.reshape.default, m.weight, [heads, -1, latent_dim])
        w_key = _call(graph, aten.slice.Tensor, weight, 1, 0, m.nope)
        w_value = _call(graph, aten.transpose.int, _call(graph, aten.slice.Tensor, weight, 1, m.nope), 1, 2)
        q_latent = _per_head_matmul(graph, q_nope, w_key, (batch, heads, rows, m.nope, latent_dim))
        latent = _call(graph, aten.reshape.default, m.latent, [batch, keys, latent_dim])
        rope = _call(graph, aten.reshape.default, m.k_rope, [batch, keys, rope_dim])
        score = _call(graph, aten.add.Tensor, _scores(graph, q_latent, latent, batch, latent_dim),
                      _scores(graph, q_rope, rope, batch, rope_dim))
        score = _call(graph, aten.mul.Tensor, score, m.scale)
        score = _call(graph, aten.reshape.default, score, [batch, heads, rows, keys])
        if m.mask is not None:
            score = _call(graph, aten.add.Tensor, score, m.mask)
        probs = graph.call_function(m.softmax.target, (score, -1, *m.softmax.args[2:]), dict(m.softmax.kwargs))
        flat_probs = _call(graph, aten.reshape.default, probs, [batch, -1, keys])
        out_latent = _call(graph, aten.reshape.default, _call(graph, aten.bmm.default, flat_probs, latent),
                           [batch, heads, rows, latent_dim])
        out = _per_head_matmul(graph, out_latent, w_value, (batch, heads, rows, latent_dim, value_dim))
        result = materialize(graph, out, m.out_dims, m.tracer.trace(m.anchor).dims)
    m.anchor.replace_all_uses_with(result)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    return fuse_matches(gm, {aten.bmm.default, aten.mm.default}, match, rewrite, PATTERN)

"""fuse_lightning_indexer: relevance scoring + head weighting + (mask) + top-k -> `ascend_dsa.lightning_indexer`.

Pattern (anchored on `topk` over the last dim, largest):
    score[b,t,s] = c · Σ_h w[b,t,h] · ReLU(c' · Σ_d q[b,t,h,d] · k[b,s,d])   (c' > 0), optionally masked
The score may be written with einsum, matmul or bmm, `*` + `sum` or a matmul with the weights, with or
without dtype casts and scales (axis_trace reads all of them alike). Masks (masked_fill / where with -inf, or
an additive mask) become per-batch lengths through `ascend_dsa.causal_lengths`, which checks at run time
that the mask is right-down causal. Keys read from a paged cache (`cache[block_table]`) are passed as the
cache itself with layout PA_BSND: no copy. The fused op pads with -1 where eager top-k returns masked keys;
for consumers that are not fused, -1 becomes the last key position (masked whenever padding occurs).
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx
import torch.utils._sympy.functions as sympy_functions

from npu_graph.pass_api import MetaKey, PassContext, PassResult
from npu_graph.passes.canonical.masks import Mask, peel_mask, triangle
from npu_graph.passes.canonical.printer import canonical_text
from npu_graph.passes.canonical.terms import Contraction, contraction
from npu_graph.passes.matching.axis_trace import Dim, Expr, TraceError, Tracer, as_leaf, flat
from npu_graph.passes.matching.fusion_graph import causal_lengths_from_mask, fuse_matches, int32_table, leaf_root_ids
from npu_graph.passes.matching.match_util import NoMatch, paged_read, topk_parts
from npu_graph.passes.matching.materialize import materialize, size_arg
from npu_graph.passes.matching.values import arg, known_positive, val

NAME = "fuse_lightning_indexer"
INFERENCE_ONLY = True
PATTERN = "topk(Σ_h w·relu(q·k) + mask)"

aten = torch.ops.aten


@dataclass
class IndexerMatch:
    topk: torch.fx.Node
    count: int                      # the fused op's sparse_count: top-k's count, or its static bound
    count_arg: object               # top-k's count as the graph has it (an int, or a symbolic size node)
    tracer: Tracer
    q: torch.fx.Node
    k: torch.fx.Node
    w: torch.fx.Node
    batch: list
    rows: list
    heads: list
    depth: list
    keys: Dim
    scale: float
    mask: Mask | None
    scalars: list = field(default_factory=list)    # 0-dim tensors the scale is multiplied by


def _relu_terms(c: Contraction) -> tuple[list[Expr], list[Expr]]:
    return [f for f in c.factors if f.kind == "relu"], [f for f in c.factors if f.kind != "relu"]


def _near(tracer: Tracer, score: Expr) -> bool:
    """Worth a near miss: the score is a contraction with a factor that is an elementwise function (relu or another)
    of a contraction — the shape of the indexer, whatever differs."""
    top = contraction(tracer, score)
    inner = [f for f in top.factors if f.kind in ("relu", "unary") and f.factors]
    return bool(top.reduced) and any(contraction(tracer, f.factors[0]).reduced for f in inner)


def _split_factors(tracer: Tracer, expr: Expr) -> tuple[Expr, Expr, Expr, Contraction, float, list]:
    """(w, q, k as leaves, the q·k contraction, the constant scale, the 0-dim scale factors) from
    c·Σ_h w·relu(c'·Σ_d q·k), read as canonical contractions (canonical/terms.py)."""
    top = contraction(tracer, expr)
    relus, others = _relu_terms(top)
    if not relus:
        found = next((f for f in top.factors if f.kind == "unary"), None)
        raise NoMatch("the score applies another function than relu to q·k", differs=_differs(found, "relu"))
    if len(relus) != 1 or len(others) != 1:
        raise NoMatch("score is not Σ_h w · relu(...)",
                      differs=f"{len(others)} factors beside relu(q·k) where the pattern has one (the head weights)")
    inner = contraction(tracer, relus[0].factors[0])
    if len(inner.factors) != 2 or not inner.reduced:
        raise NoMatch("relu input is not a contraction of two tensors",
                      differs=f"relu of a product of {len(inner.factors)} tensors where the pattern has q·k")
    if inner.scale <= 0 or not all(known_positive(s) for s in inner.scalars):
        raise NoMatch("a non-positive scale (or one not known positive) inside the relu does not commute with it")
    w = as_leaf(tracer, others[0])
    a, b = (as_leaf(tracer, f) for f in inner.factors)
    w_axes = _roots(tracer, w)
    q, k = (a, b) if len(_roots(tracer, a) & w_axes) >= len(_roots(tracer, b) & w_axes) else (b, a)
    return w, q, k, inner, top.scale * relus[0].scale * inner.scale, top.scalars + inner.scalars


def _differs(found: Expr | None, wanted: str) -> str:
    name = getattr(getattr(found, "node", None), "target", None)
    return f"{getattr(name, '_opname', name)}(q·k) where the pattern has {wanted}(q·k)"


def _roots(tracer: Tracer, leaf: Expr) -> set[int]:
    return leaf_root_ids(tracer, leaf.node)


def _roles(tracer: Tracer, score_dims: list[Dim], leaves: tuple[Expr, Expr, Expr], heads: list, depth: list
           ) -> dict:
    rw, rq, rk = (_roots(tracer, e) for e in leaves)
    depth_ids, heads_ids = {id(a) for a in flat(depth)}, {id(a) for a in flat(heads)}
    depth = [a for d in tracer.leaf_dims[leaves[2].node] for a in flat(d) if id(a) in depth_ids]
    heads = [a for d in tracer.leaf_dims[leaves[1].node] for a in flat(d) if id(a) in heads_ids]
    if not all(id(a) in rq & rk for a in depth) or not all(id(a) in (rq & rw) - rk for a in heads):
        raise NoMatch("the contracted axes are not (head dim of q and k) and (heads of q and w)")
    *others, keys = score_dims
    if not keys or not all(id(a) in rk - rq - rw for a in flat(keys)):
        raise NoMatch("top-k does not run over the key axis")
    batch, rows = [], []
    for a in (a for dim in others for a in flat(dim)):
        root = id(a)
        if root in rq & rk & rw and not rows:
            batch.append(a)
        elif root in (rq & rw) - rk:
            rows.append(a)
        else:
            raise NoMatch("score dims are not (batch..., query..., key)")
    return {"batch": batch, "rows": rows, "heads": heads, "depth": depth, "keys": keys}


def static_count(count: object) -> int | None:
    """top-k's count when it is an int, or the static bound of a symbolic count min(K, ...) (a DSA model's
    `min(index_topk, cache length)`): the fused op then selects K and the result is sliced to the count."""
    if isinstance(count, int):
        return count
    value = count.meta.get("val") if isinstance(count, torch.fx.Node) else None
    expr = value.node.expr if isinstance(value, torch.SymInt) else None
    if isinstance(expr, (sympy.Min, sympy_functions.Min)):
        bounds = [int(a) for a in expr.args if a.is_Integer]
        return min(bounds) if bounds else None
    return None


def match(topk: torch.fx.Node) -> IndexerMatch:
    x, count_arg = topk.args[0], topk.args[1]
    count = static_count(count_arg)
    dim, largest = arg(topk, 2, -1), arg(topk, 3, True)
    score, mask = peel_mask(x)
    tracer = Tracer()
    traced = tracer.trace(score)
    expr = traced.expr
    near = _near(tracer, expr)
    try:
        _check_selection(x, count, dim, largest, mask)
        w, q, k, inner, scale, scalars = _split_factors(tracer, expr)
        roles = _roles(tracer, traced.dims, (w, q, k), list(contraction(tracer, expr).reduced), list(inner.reduced))
    except (NoMatch, TraceError, KeyError) as exc:
        text = canonical_text(tracer, expr) if near else None
        raise NoMatch(str(exc), near, text, getattr(exc, "differs", None)) from exc
    return IndexerMatch(topk, count, count_arg, tracer, q.node, k.node, w.node, scale=scale, mask=mask,
                        scalars=scalars, **roles)


def _check_selection(x: torch.fx.Node, count: int | None, dim: int, largest: bool, mask: Mask | None) -> None:
    """Top-k over the last dim, largest first, with a static count; a mask of no more dims than the score and not
    shown by the graph to let queries see later keys (the op is causal)."""
    if count is None or dim % val(x).dim() != val(x).dim() - 1 or not largest:
        raise NoMatch("top-k is not over the last dim, largest first, with a static count or bound")
    extra = val(mask.tensor).dim() - val(x).dim() if mask is not None else 0
    if extra > 0 and any(s != 1 for s in val(mask.tensor).shape[:extra]):
        raise NoMatch("the mask has more dims than the score")
    if mask is not None and triangle(mask) == "upper":
        raise NoMatch("the mask is not causal: it lets each query see the keys after its position",
                      differs="an upper-triangular mask where the pattern has a causal (lower-triangular) one")


def _key_input(graph: torch.fx.Graph, m: IndexerMatch) -> tuple[torch.fx.Node, torch.fx.Node | None, str]:
    paged = paged_read(m.k)
    dims = m.tracer.leaf_dims[m.k]
    if paged is not None and len(dims) == 5 and flat(m.keys) == flat(dims[1] + dims[2]):
        cache, table = paged
        return cache, int32_table(graph, table), "PA_BSND"
    key = materialize(graph, m.k, dims, [tuple(m.batch), tuple(m.keys), (), tuple(m.depth)])
    return key, None, "BSND"


def _lengths(graph: torch.fx.Graph, m: IndexerMatch, score: torch.fx.Node, windows: bool
             ) -> tuple[object, object, object]:
    if m.mask is None:
        return None, None, None
    score_shape = [size_arg(graph, list(d)) for d in m.tracer.trace(score).dims]
    flat_shape = [size_arg(graph, m.batch), size_arg(graph, m.rows), size_arg(graph, m.keys)]
    return causal_lengths_from_mask(graph, m.mask.tensor, score_shape, flat_shape, m.mask.kind, windows=windows)


def rewrite(gm: torch.fx.GraphModule, m: IndexerMatch, windows: bool = False) -> None:
    graph = gm.graph
    values_out, indices_out = topk_parts(m.topk)
    with graph.inserting_before(m.topk):
        q = materialize(graph, m.q, m.tracer.leaf_dims[m.q], [tuple(m.batch), tuple(m.rows), tuple(m.heads),
                                                                tuple(m.depth)])
        w = materialize(graph, m.w, m.tracer.leaf_dims[m.w], [tuple(m.batch), tuple(m.rows), tuple(m.heads)])
        if m.scale != 1.0:
            w = graph.call_function(aten.mul.Tensor, (w, m.scale))
        for scalar in m.scalars:
            w = graph.call_function(aten.mul.Tensor, (w, scalar))
        key, table, layout = _key_input(graph, m)
        lengths_q, lengths_k, starts = _lengths(graph, m, peel_mask(m.topk.args[0])[0], windows)
        fused = graph.call_function(torch.ops.ascend_dsa.lightning_indexer.default,
                                    (q, key, w, lengths_q, lengths_k, table, None, None, starts),
                                    {"layout_key": layout, "sparse_count": m.count,
                                     "sparse_mode": 3 if m.mask is not None else 0})
        _replace_outputs(graph, m, fused, values_out, indices_out)


def _replace_outputs(graph: torch.fx.Graph, m: IndexerMatch, fused: torch.fx.Node, values_out, indices_out) -> None:
    out_shape = [size_arg(graph, list(d)) for d in m.tracer.trace(peel_mask(m.topk.args[0])[0]).dims[:-1]]
    out_shape.append(m.count)
    if indices_out is not None:
        idx = _to_count(graph, m, graph.call_function(operator.getitem, (fused, 0)), out_shape)
        keys = size_arg(graph, list(m.keys))
        last = keys - 1 if isinstance(keys, int) else graph.call_function(operator.sub, (keys, 1))
        padded = graph.call_function(aten.lt.Scalar, (idx, 0))
        idx = graph.call_function(aten.where.ScalarSelf, (padded, last, idx))
        idx = graph.call_function(aten._to_copy.default, (idx,), {"dtype": val(indices_out).dtype})
        idx.meta[MetaKey.FUSED_INDEXER] = fused
        indices_out.replace_all_uses_with(idx)
    if values_out is not None:
        values = _to_count(graph, m, graph.call_function(operator.getitem, (fused, 1)), out_shape)
        values = graph.call_function(aten._to_copy.default, (values,), {"dtype": val(values_out).dtype})
        values_out.replace_all_uses_with(values)


def _to_count(graph: torch.fx.Graph, m: IndexerMatch, part: torch.fx.Node, shape: list) -> torch.fx.Node:
    """One output of the fused op in top-k's shape: reshaped, and sliced to a symbolic count (the fused op
    selected its static bound; its results are sorted, so the first `count` are top-k's)."""
    part = graph.call_function(aten.reshape.default, (part, shape))
    if isinstance(m.count_arg, torch.fx.Node):
        part = graph.call_function(aten.slice.Tensor, (part, -1, 0, m.count_arg))
    return part


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    windows = ctx.machine.dsa_key_starts
    return fuse_matches(gm, {aten.topk.default}, match, functools.partial(rewrite, windows=windows), PATTERN)

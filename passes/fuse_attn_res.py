"""fuse_attn_res: Kimi block attention residuals (softmax over depth of normalized layer outputs) ->
`ascend_dsa.attn_res`.

Pattern (anchored on `softmax`):
    h[...] = Σ_n softmax_n(c · Σ_d q[d] · K[n, ..., d]) · v[n, ..., d],   K = RMSNorm(v) over d
where K is `ascend_dsa.rms_norm(v, gamma, eps)` (fuse_rms_norm runs first; in low precision its weight is
multiplied after the cast back, which is just one more factor over d), or the unfused RMSNorm that
fuse_rms_norm recognizes (when that pass is disabled). Every other factor of the logits (the pseudo-query,
a weight multiplied after the cast, a constant c) depends on the hidden axis d only and is folded, in fp32,
into the op's single query. The contractions may be einsum, matmul, bmm or `*` + `sum` (axis_trace reads
them alike, except `matmul(keys, q)` with a 1-D q, which is `aten.mv`); the depth axis n may be any axis of
v except d. All values go to the op as `blocks` [N, B·T, 1, D] with `partial=None` (the op allows it for
N >= 1); a softmax over a single source is not fused.
The op computes in fp32 and returns the weighted sum's dtype: for fp32 models this is the model's own
arithmetic up to rounding order; in bf16 the eager form rounds keys and logits to bf16 where the op does not,
so compiled and eager differ by about that rounding (the op's bf16 tolerance, 2e-2, holds in the tests).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.fuse_rms_norm import parse_norm
from npu_graph.passes.matching.axis_trace import Axis, Dim, Expr, Tracer, Value, as_leaf, flat
from npu_graph.passes.matching.fusion_graph import fuse_matches, readers
from npu_graph.passes.matching.match_util import NoMatch
from npu_graph.passes.matching.materialize import materialize
from npu_graph.passes.matching.values import arg, fill_value, same_size, val

NAME = "fuse_attn_res"
INFERENCE_ONLY = True
PATTERN = "Σ_n softmax_n(q·RMSNorm(v_n))·v_n"

aten = torch.ops.aten
Node = torch.fx.Node
RMS_NORM = torch.ops.ascend_dsa.rms_norm.default
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
MAX_HOPS = 8  # how far after the softmax the weighted sum may be (views, permutes, bmm)


@dataclass
class NormLeaf:
    """node = RMSNorm(values) · gamma (gamma None: no weight inside the norm)."""

    node: Node
    values: Node
    gamma: Node | None
    eps: float


@dataclass
class AttnResMatch:
    tracer: Tracer
    out: Node
    values: Node
    queries: list[Node]
    scale: float
    norm: NormLeaf
    depth: list[Axis]
    rest: list[Axis]
    hidden: list[Axis]


def _atoms(dims: list[Dim]) -> list[Axis]:
    return [a for d in dims for a in flat(d)]


def _ids(axes: object) -> set[int]:
    return {id(a) for a in flat(tuple(axes))}


def _norm_leaf(node: Node) -> NormLeaf | None:
    """The RMSNorm `node` computes: getitem 0 of ascend_dsa.rms_norm, or the unfused form."""
    source = node.args[0] if node.target is operator.getitem and node.args[1] == 0 else None
    if getattr(source, "target", None) == RMS_NORM:
        x, gamma = source.args[:2]
        eps = arg(source, 2, 1e-6, "epsilon")
        return NormLeaf(node, x, None if fill_value(gamma) == 1 else gamma, eps) if val(gamma).dim() == 1 else None
    try:
        norm = parse_norm(node)
    except NoMatch:
        return None
    return NormLeaf(node, norm.xf, None, norm.eps) if not norm.weights else None


def _norms_in(expr: Expr, found: dict[Node, NormLeaf | None]) -> dict[Node, NormLeaf | None]:
    if expr.node is not None and expr.node.op == "call_function" and expr.node not in found:
        found[expr.node] = _norm_leaf(expr.node)
    for factor in expr.factors:
        _norms_in(factor, found)
    return found


def _product(expr: Expr) -> tuple[list[Expr], set[Axis], float]:
    """An expression read as scale · Σ_reduced Π factors (mul, matmul and sum nest freely)."""
    if expr.kind not in ("mul", "matmul", "sum"):
        return [expr], set(), 1.0
    factors, reduced, scale = [], set(expr.reduced), expr.scale
    for f in expr.factors:
        sub, sub_reduced, sub_scale = _product(f)
        factors += sub
        reduced |= sub_reduced
        scale *= sub_scale
    return factors, reduced, scale


def _seeded_tracer(logits: Node) -> tuple[Tracer, dict[Node, NormLeaf]]:
    """A tracer that sees every RMSNorm under the logits as a leaf with the axes of its values."""
    norms = {n: leaf for n, leaf in _norms_in(Tracer().trace(logits).expr, {}).items() if leaf is not None}
    tracer = Tracer()
    for node, leaf in norms.items():
        tracer.memo[node] = Value(list(tracer.trace(leaf.values).dims), Expr("leaf", node=node))
        tracer.leaf_dims[node] = tracer.memo[node].dims
    return tracer, norms


def _depth_attention(tracer: Tracer, factors: list[Expr], reduced: set, softmax: Expr) -> bool:
    """The shape of AttnRes without its norm: a vector over the contracted (hidden) axis only, dotted with values
    the softmax runs over a depth axis of (attention over tokens has queries with token axes: not this)."""
    if len(factors) != 2 or not reduced:
        return False
    axes = [_ids(_atoms(tracer.trace(f.node).dims)) for f in factors]
    hidden, depth = _ids(reduced), _ids(softmax.axes)
    return any(a <= hidden and depth <= b for a, b in (axes, axes[::-1]))


def _logits(tracer: Tracer, softmax: Node, norms: dict[Node, NormLeaf]) -> tuple[NormLeaf, list[Expr], float]:
    """(the norm, the other factors, the scale) of logits = c · Σ_d Π factors; checks the axes."""
    expr = tracer.trace(softmax).expr
    factors, reduced, scale = _product(expr.factors[0]) if expr.kind == "softmax" else ([], set(), 1.0)
    keys = [f for f in factors if f.kind == "leaf" and f.node in norms]
    if len(keys) != 1:
        raise NoMatch("the logits are not a contraction with one RMSNorm of the values",
                      near=_depth_attention(tracer, factors, reduced, expr),
                      differs="w·v where the pattern has w·RMSNorm(v)")
    norm = norms[keys[0].node]
    vdims = tracer.trace(norm.values).dims
    hidden = _ids(vdims[-1])
    if not _ids(expr.axes) <= _ids(_atoms(vdims)) - hidden:
        raise NoMatch("the softmax is not over a depth axis of the normalized values", near=False)
    if _ids(reduced) != hidden:
        raise NoMatch("the logits do not contract exactly the normalized hidden axis")
    others = [f for f in factors if f is not keys[0]]
    if not others:
        raise NoMatch("the logits have no pseudo-query")
    if any(not _ids(_atoms(tracer.trace(f.node).dims)) <= hidden for f in others):
        raise NoMatch("a factor of the logits depends on more than the hidden axis")
    return norm, others, scale


def _weighted_sum(tracer: Tracer, softmax: Node, values: Expr, depth: set[int]) -> Node:
    """The first node within MAX_HOPS after the softmax that is Σ_depth softmax · values."""
    for node in readers(softmax, MAX_HOPS):
        factors, reduced, scale = _product(tracer.trace(node).expr)
        kinds = {f.node if f.kind == "softmax" else f for f in factors}
        if len(factors) == 2 and kinds == {softmax, values} and _ids(reduced) == depth and scale == 1.0:
            return node
    raise NoMatch("no weighted sum Σ_n softmax · v over the same depth axis follows the softmax")


def match(softmax: Node) -> AttnResMatch:
    logits, dim = softmax.args[0], softmax.args[1]
    if softmax.args[2] or same_size(val(logits).shape[dim], 1):
        raise NoMatch("softmax in another dtype or over a single source", near=False)
    tracer, norms = _seeded_tracer(logits)
    norm, others, scale = _logits(tracer, softmax, norms)
    vdims = tracer.trace(norm.values).dims
    depth, hidden = _ids(tracer.trace(softmax).expr.axes), flat(vdims[-1])
    out = _weighted_sum(tracer, softmax, tracer.trace(norm.values).expr, depth)
    rest = [a for a in _atoms(vdims) if id(a) not in depth and id(a) not in _ids(hidden)]
    if sorted(map(id, _atoms(tracer.trace(out).dims))) != sorted(map(id, rest + list(hidden))):
        raise NoMatch("the weighted sum is not laid out over the values' axes without depth")
    if val(out).dtype not in FLOATS or not isinstance(norm.eps, float) or norm.eps < 0:
        raise NoMatch(f"unsupported dtype {val(out).dtype} or eps {norm.eps!r}")
    values = as_leaf(tracer, tracer.trace(norm.values).expr).node
    queries = [as_leaf(tracer, f).node for f in others]
    depth_axes = [a for a in _atoms(vdims) if id(a) in depth]
    return AttnResMatch(tracer, out, values, queries, scale, norm, depth_axes, rest, list(hidden))


def _query(graph: torch.fx.Graph, m: AttnResMatch) -> Node:
    """The product of the logits' factors over the hidden axis (and the scale), fp32 [1, D]."""
    query = None
    for node in m.queries:
        q = materialize(graph, node, m.tracer.leaf_dims[node], [(), tuple(m.hidden)])
        q = graph.call_function(aten._to_copy.default, (q,), {"dtype": torch.float32})
        query = q if query is None else graph.call_function(aten.mul.Tensor, (query, q))
    return query if m.scale == 1.0 else graph.call_function(aten.mul.Tensor, (query, m.scale))


def rewrite(gm: torch.fx.GraphModule, m: AttnResMatch) -> None:
    graph = gm.graph
    with graph.inserting_before(m.out):
        blocks = materialize(graph, m.values, m.tracer.leaf_dims[m.values],
                             [tuple(m.depth), tuple(m.rest), (), tuple(m.hidden)])
        if val(m.values).dtype != val(m.out).dtype:
            blocks = graph.call_function(aten._to_copy.default, (blocks,), {"dtype": val(m.out).dtype})
        fused = graph.call_function(torch.ops.ascend_dsa.attn_res.default,
                                    (blocks, None, _query(graph, m), m.norm.gamma), {"eps": m.norm.eps})
        out = materialize(graph, fused, [(), tuple(m.rest), (), tuple(m.hidden)], m.tracer.trace(m.out).dims)
    out.meta["val"] = m.out.meta["val"]  # later matches in this run read it; refresh_meta redoes all
    m.out.replace_all_uses_with(out)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    return fuse_matches(gm, {aten._softmax.default}, match, rewrite, PATTERN, trace_errors_are_near=True)

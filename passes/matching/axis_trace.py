"""Axis tracing: read a chain of ATen views, permutes, broadcasts, casts, (b)mm, mul, sum, relu and softmax
as the einsum-like expression it computes, whatever way the model wrote it (einsum, matmul, bmm, `*`+`sum`).

Every dimension of a traced value is a tuple of atomic axes (merged dims list several; size-1 dims list
none). Leaves are the first nodes the tracer cannot see through; each leaf dim gets a fresh axis. A fusion
pass then asks structural questions ("which axis is contracted between q and k?") instead of matching one
exact op sequence, and rebuilds its inputs from leaves with `materialize` (materialize.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from npu_graph.passes.matching.axis_algebra import (
    Axis,
    Dim,
    TraceError,
    dim_size,
    find,
    flat,
    regroup,
    unify_dim,
)
from npu_graph.passes.matching.values import CASTS, RESHAPES, UNIT_DIMS, arg, is_neg_inf, same_size

__all__ = ["Axis", "Dim", "Expr", "TraceError", "Tracer", "Value", "as_leaf", "dim_size", "find", "flat", "flatten",
           "softmax_of", "unify_dim"]

aten = torch.ops.aten
@dataclass(eq=False)
class Expr:
    """kind: leaf | matmul | mul | sum | add | masked | relu | unary | softmax; `node` is the node whose value this is
    (its constant factor `scale` included); `reduced` are the axes a matmul or sum contracts."""

    kind: str
    node: torch.fx.Node | None = None
    factors: tuple[Expr, ...] = ()
    reduced: frozenset = frozenset()
    scale: float = 1.0
    axes: tuple[Axis, ...] = ()

    def leaves(self) -> list[Expr]:
        if self.kind == "leaf":
            return [self]
        return [leaf for f in self.factors for leaf in f.leaves()]


@dataclass
class Value:
    dims: list[Dim]
    expr: Expr


def _shape(node: torch.fx.Node) -> list[object]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise TraceError(f"{node.name} has no tensor metadata")
    return list(val.shape)


_TRANSPARENT = CASTS | {aten.contiguous.default, aten.lift_fresh_copy.default}
UNARY = frozenset({aten.gelu.default, aten.silu.default, aten.sigmoid.default, aten.tanh.default, aten.exp.default,
                   aten.abs.default, aten.sqrt.default, aten.rsqrt.default, aten.log.default, aten.erf.default,
                   aten.elu.default, aten.leaky_relu.default, aten.hardtanh.default, aten.softplus.default,
                   aten.square.default})


class Tracer:
    """Traces values backwards from a node; one Tracer per match attempt (it memoises leaves)."""

    def __init__(self, stop: set[torch.fx.Node] | None = None):
        self.memo: dict[torch.fx.Node, Value] = {}
        self.leaf_dims: dict[torch.fx.Node, list[Dim]] = {}
        self.stop = stop or set()

    def trace(self, node: torch.fx.Node) -> Value:
        if node not in self.memo:
            try:
                self.memo[node] = self._trace(node) if node not in self.stop else self.leaf(node)
            except TraceError:
                self.memo[node] = self.leaf(node)
        return self.memo[node]

    def leaf(self, node: torch.fx.Node) -> Value:
        dims = [() if same_size(s, 1) else (Axis(s, source=(node, i)),) for i, s in enumerate(_shape(node))]
        self.leaf_dims[node] = dims
        return Value(list(dims), Expr("leaf", node=node))

    def _trace(self, node: torch.fx.Node) -> Value:
        if node.op != "call_function":
            raise TraceError("not a call")
        handler = _HANDLERS.get(node.target)
        if handler is None:
            raise TraceError(f"{node.target} is opaque")
        return handler(self, node)


def _view(t: Tracer, node: torch.fx.Node) -> Value:
    """A reshape, unsqueeze or squeeze: the same atoms regrouped into the node's shape."""
    src = t.trace(node.args[0])
    return Value(regroup(src.dims, _shape(node)), src.expr)


def _permute(t: Tracer, node: torch.fx.Node) -> Value:
    src = t.trace(node.args[0])
    order = [d % len(src.dims) for d in node.args[1]]
    return Value([src.dims[d] for d in order], src.expr)


def _transpose(t: Tracer, node: torch.fx.Node) -> Value:
    src = t.trace(node.args[0])
    dims = list(src.dims)
    if node.target == aten.t.default:
        a, b = 0, len(dims) - 1
    else:
        a, b = (d % len(dims) for d in node.args[1:3])
    dims[a], dims[b] = dims[b], dims[a]
    return Value(dims, src.expr)


def _select(t: Tracer, node: torch.fx.Node) -> Value:
    src = t.trace(node.args[0])
    dim = node.args[1] % len(src.dims)
    if src.dims[dim]:
        raise TraceError("select on a non-unit dim")
    return Value(src.dims[:dim] + src.dims[dim + 1:], src.expr)


def _masked(t: Tracer, node: torch.fx.Node) -> Value:
    """masked_fill(x, m, -inf) / where(m, x, -inf): elementwise on x (the mask is read by the pass)."""
    fill = node.args[2]
    source = node.args[0] if node.target != aten.where.self else node.args[1]
    if not is_neg_inf(fill) or not isinstance(source, torch.fx.Node):
        raise TraceError("not a -inf mask")
    src = t.trace(source)
    if len(src.dims) != len(_shape(node)):
        raise TraceError("mask broadcasts the score")
    return Value(src.dims, Expr("masked", node=node, factors=(src.expr,)))


def _expand(t: Tracer, node: torch.fx.Node) -> Value:
    src = t.trace(node.args[0])
    shape = _shape(node)
    dims = [()] * (len(shape) - len(src.dims)) + list(src.dims)
    out = []
    for d, size in zip(dims, shape):
        out.append(d if d or same_size(size, 1) else (Axis(size, broadcast=True),))
    return Value(out, src.expr)


def _passthrough(t: Tracer, node: torch.fx.Node) -> Value:
    return t.trace(node.args[0])


def _contract(kind: str, node: torch.fx.Node, factors: list[Value], out_dims: list[Dim], reduced: set[Axis]
              ) -> Value:
    exprs = tuple(f.expr for f in factors)
    return Value(out_dims, Expr(kind, node=node, factors=exprs, reduced=frozenset(reduced)))


def _bmm(t: Tracer, node: torch.fx.Node) -> Value:
    a, b = t.trace(node.args[0]), t.trace(node.args[1])
    batch = [unify_dim(x, y) for x, y in zip(a.dims[:-2], b.dims[:-2])]
    contracted = unify_dim(a.dims[-1], b.dims[-2])
    outer = not a.dims[-1] and not b.dims[-2]     # a size-1 contraction: an outer product
    if (not contracted and not outer) or any(x.broadcast for x in flat(contracted)):
        raise TraceError("matmul contracts different axes")
    return _contract("mul" if outer else "matmul", node, [a, b], [*batch, a.dims[-2], b.dims[-1]],
                     set(flat(contracted)))


def _broadcast_dims(a: Value, b: Value) -> list[Dim]:
    """The dims of an elementwise op on `a` and `b`: aligned from the right, each pair unified."""
    rank = max(len(a.dims), len(b.dims))
    da = [()] * (rank - len(a.dims)) + list(a.dims)
    db = [()] * (rank - len(b.dims)) + list(b.dims)
    return [unify_dim(p, q) for p, q in zip(da, db)]


def _mul(t: Tracer, node: torch.fx.Node) -> Value:
    x, y = node.args[0], node.args[1]
    if not isinstance(y, torch.fx.Node) or not isinstance(x, torch.fx.Node):
        src = t.trace(x if isinstance(x, torch.fx.Node) else y)
        factor = y if isinstance(x, torch.fx.Node) else x
        if node.target in (aten.div.Tensor, aten.div.Scalar):
            factor = 1.0 / factor
        expr = Expr(src.expr.kind, node, src.expr.factors, src.expr.reduced, src.expr.scale * float(factor),
                    src.expr.axes)
        return Value(src.dims, expr)
    if node.target == aten.div.Tensor:
        raise TraceError("division by a tensor")
    a, b = t.trace(x), t.trace(y)
    return _contract("mul", node, [a, b], _broadcast_dims(a, b), set())


def _add(t: Tracer, node: torch.fx.Node) -> Value:
    x, y = node.args[0], node.args[1]
    if not (isinstance(x, torch.fx.Node) and isinstance(y, torch.fx.Node)) or node.kwargs.get("alpha", 1) != 1:
        raise TraceError("add of a constant or with alpha")
    a, b = t.trace(x), t.trace(y)
    second = b.expr
    if node.target == aten.sub.Tensor:     # x − y: the second term with the scale −1
        second = Expr(second.kind, second.node, second.factors, second.reduced, -second.scale, second.axes)
    return Value(_broadcast_dims(a, b), Expr("add", node=node, factors=(a.expr, second)))


def _sum(t: Tracer, node: torch.fx.Node) -> Value:
    src = t.trace(node.args[0])
    dims = arg(node, 1, list(range(len(src.dims))))
    dims = {d % len(src.dims) for d in ([dims] if isinstance(dims, int) else dims)}
    keep = arg(node, 2, False)
    reduced = {a for i in dims for a in flat(src.dims[i])}
    out = [(() if i in dims else d) for i, d in enumerate(src.dims) if keep or i not in dims]
    return Value(out, Expr("sum", node=node, factors=(src.expr,), reduced=frozenset(reduced)))


def _relu(t: Tracer, node: torch.fx.Node) -> Value:
    src = t.trace(node.args[0])
    return Value(src.dims, Expr("relu", node=node, factors=(src.expr,)))


def _unary(t: Tracer, node: torch.fx.Node) -> Value:
    """Another elementwise function of one tensor (gelu, sigmoid, exp...): kind "unary", named by its node's op,
    so that a near miss can say which function stands where a pattern wants another."""
    if any(isinstance(a, torch.fx.Node) for a in node.args[1:]):
        raise TraceError(f"{node.target} of several tensors")
    src = t.trace(node.args[0])
    return Value(src.dims, Expr("unary", node=node, factors=(src.expr,)))


def _negate(t: Tracer, node: torch.fx.Node) -> Value:
    src = t.trace(node.args[0])
    e = src.expr
    return Value(src.dims, Expr(e.kind, node, e.factors, e.reduced, -e.scale, e.axes))


def _softmax(t: Tracer, node: torch.fx.Node) -> Value:
    src = t.trace(node.args[0])
    dim = src.dims[node.args[1] % len(src.dims)]
    if not dim:
        raise TraceError("softmax over a size-1 dim")
    return Value(src.dims, Expr("softmax", node=node, factors=(src.expr,), axes=tuple(dim)))


_HANDLERS = {
    **dict.fromkeys(RESHAPES | UNIT_DIMS, _view),
    **dict.fromkeys(_TRANSPARENT, _passthrough),
    aten.permute.default: _permute,
    aten.transpose.int: _transpose,
    aten.t.default: _transpose,
    aten.expand.default: _expand,
    aten.select.int: _select,
    aten.masked_fill.Scalar: _masked,
    aten.where.self: _masked,
    aten.bmm.default: _bmm,
    aten.mm.default: _bmm,
    aten.mul.Tensor: _mul,
    aten.div.Tensor: _mul,
    aten.mul.Scalar: _mul,
    aten.div.Scalar: _mul,
    aten.add.Tensor: _add,
    aten.sub.Tensor: _add,
    aten.sum.dim_IntList: _sum,
    aten.relu.default: _relu,
    aten.neg.default: _negate,
    **dict.fromkeys(UNARY, _unary),
    aten._softmax.default: _softmax,
}


POINTWISE = ("mul", "sum")


def flatten(expr: Expr) -> Expr:
    """Merge nested pointwise products and sums into one (matmul, relu and softmax stay boundaries)."""
    if expr.kind not in POINTWISE:
        return expr
    factors: list[Expr] = []
    reduced, scale = set(expr.reduced), expr.scale
    for factor in map(flatten, expr.factors):
        if factor.kind in POINTWISE:
            factors += factor.factors
            reduced |= factor.reduced
            scale *= factor.scale
        else:
            factors.append(factor)
    return Expr("mul", node=expr.node, factors=tuple(factors), reduced=frozenset(reduced), scale=scale)


def softmax_of(tracer: Tracer, expr: Expr) -> tuple[Expr, list[Axis], torch.fx.Node] | None:
    """(softmax input, softmax axes, softmax node) when `expr` is a softmax or `_safe_softmax` over one dim."""
    if expr.kind == "softmax":
        exact = expr.scale == 1.0 and expr.node.target == aten._softmax.default
        return (expr.factors[0], list(flat(expr.axes)), expr.node) if exact else None
    node = expr.node if expr.kind == "leaf" else None
    if node is None or node.target != aten._safe_softmax.default or expr.scale != 1.0:
        return None
    src = tracer.trace(node.args[0])
    dims = tracer.leaf_dims[node]
    if len(dims) != len(src.dims):
        return None
    for mine, theirs in zip(dims, src.dims):
        unify_dim(mine, theirs)
    axes = src.dims[node.args[1] % len(src.dims)]
    return (src.expr, list(flat(axes)), node) if axes else None


def as_leaf(tracer: Tracer, expr: Expr) -> Expr:
    """Treat the node holding `expr` as a leaf (its value, scale included, is used as it is)."""
    if expr.node not in tracer.leaf_dims:
        tracer.leaf_dims[expr.node] = tracer.memo[expr.node].dims
    return Expr("leaf", node=expr.node)

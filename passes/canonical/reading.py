"""Reading a node as the function it computes, where spellings of one function round differently: the fusion
passes accept each spelling as the canonical op, and the graph keeps what the model wrote until a fused op
replaces it (unfused code keeps eager's numbers bit for bit; rules_*.py rewrite only where the result is the
same to the bit).
- wᵀ of a matrix: t(w), transpose(w, 0, 1), permute(w, [1, 0]) (what linear, x @ w.t() and matmul give);
- rsqrt(x): rsqrt(x), reciprocal(sqrt(x)), pow(x, -0.5); a / sqrt(x) reads as a · rsqrt(x);
- mean(x, dims): mean(x, dims), sum(x, dims) / n and sum(x, dims) · (1/n) with n the count summed;
- sigmoid(x): sigmoid(x), reciprocal(exp(-x) + 1);
- silu(x): silu(x), x · sigmoid(x) (either order, either sigmoid);
- softmax(x, d): _softmax(x, d), exp(z) / Σ_d exp(z) (z = x, or x − max_d(x)), exp(log_softmax(x, d)).
The pieces of the last dim canonical_form writes as slices read as halves (x[:D/2], x[D/2:]) or pairs (x[0::2],
x[1::2]) of one x.
"""
from __future__ import annotations

import torch
import torch.fx

from npu_graph.passes.canonical.structure import Structure
from npu_graph.passes.matching.values import arg, same_size, scalar, val

aten = torch.ops.aten
Node = torch.fx.Node


def _op(node: object, target: object) -> bool:
    return isinstance(node, Node) and node.target == target


def transposed(node: object) -> Node | None:
    """w when `node` is the transpose of a 2-d w: t(w), transpose(w, 0, 1), permute(w, [1, 0])."""
    if not isinstance(node, Node) or not isinstance(node.args[0], Node) or val(node.args[0]).dim() != 2:
        return None
    swapped = (node.target == aten.transpose.int and node.args[1] % 2 != node.args[2] % 2) or \
        (node.target == aten.permute.default and [d % 2 for d in node.args[1]] == [1, 0])
    return node.args[0] if node.target == aten.t.default or swapped else None


def rsqrt_of(node: object) -> Node | None:
    """x when `node` computes rsqrt(x)."""
    if _op(node, aten.rsqrt.default):
        return node.args[0]
    if _op(node, aten.reciprocal.default) and _op(node.args[0], aten.sqrt.default):
        return node.args[0].args[0]
    if _op(node, aten.pow.Tensor_Scalar) and scalar(node.args[1]) == -0.5:
        return node.args[0]
    return None


def divided_by_root(node: object) -> tuple[Node, Node] | None:
    """(a, x) when `node` is a / sqrt(x), read as a · rsqrt(x)."""
    if _op(node, aten.div.Tensor) and isinstance(node.args[0], Node) and _op(node.args[1], aten.sqrt.default):
        return node.args[0], node.args[1].args[0]
    return None


def _count(total: Node) -> object:
    """How many elements sum.dim_IntList adds up per result."""
    source, dims = val(total.args[0]), total.args[1]
    count: object = 1
    for d in dims:
        count = count * source.shape[d]
    return count


def mean_of(node: object) -> tuple[Node, list[int], bool] | None:
    """(x, dims, keepdim) when `node` computes mean(x, dims, keepdim)."""
    if _op(node, aten.mean.dim) and arg(node, 3, None, "dtype") is None:
        return node.args[0], list(node.args[1]), bool(arg(node, 2, False, "keepdim"))
    if not (_op(node, aten.div.Tensor) or _op(node, aten.mul.Tensor)):
        return None
    total, by = node.args[:2]
    if not _op(total, aten.sum.dim_IntList) or not total.args[1] or arg(total, 3, None, "dtype") is not None:
        return None
    count = _count(total)
    by = by.meta.get("val") if isinstance(by, Node) else by     # a size Dynamo passes as an input
    if node.target == aten.mul.Tensor:
        factor = scalar(by)
        exact = factor is not None and isinstance(count, int) and abs(factor * count - 1) < 1e-12
    else:
        exact = isinstance(by, (int, torch.SymInt)) and not isinstance(by, bool) and same_size(by, count)
    return (total.args[0], list(total.args[1]), bool(arg(total, 2, False, "keepdim"))) if exact else None


def sigmoid_of(node: object) -> Node | None:
    """x when `node` computes sigmoid(x)."""
    if _op(node, aten.sigmoid.default):
        return node.args[0]
    if not _op(node, aten.reciprocal.default):
        return None
    inner = node.args[0]
    if _op(inner, aten.add.Tensor) and scalar(inner.args[1]) == 1 and _op(inner.args[0], aten.exp.default):
        negated = inner.args[0].args[0]
        return negated.args[0] if _op(negated, aten.neg.default) else None
    return None


def silu_of(node: object, structure: Structure) -> Node | None:
    """x when `node` computes silu(x)."""
    if _op(node, aten.silu.default):
        return node.args[0]
    if not _op(node, aten.mul.Tensor):
        return None
    for x, sig in (node.args[:2], node.args[1::-1]):
        inner = sigmoid_of(sig)
        if inner is not None and structure.same(x, inner):
            return x
    return None


def _one_dim(dims: object, rank: int) -> int | None:
    return dims[0] % rank if isinstance(dims, (list, tuple)) and len(dims) == 1 and rank else None


def _shifted(z: Node, dim: int, structure: Structure) -> Node:
    """x when z = x − max_dim(x) (softmax(z) is softmax(x)), else z."""
    if _op(z, aten.sub.Tensor) and _op(z.args[1], aten.amax.default) and arg(z, 2, 1, "alpha") == 1:
        peak = z.args[1]
        if _one_dim(peak.args[1], val(z).dim()) == dim and arg(peak, 2, False) \
                and structure.same(peak.args[0], z.args[0]):
            return z.args[0]
    return z


def softmax_of(node: object, structure: Structure) -> tuple[Node, int] | None:
    """(x, dim from 0) when `node` computes softmax(x, dim) in the input's dtype."""
    if _op(node, aten._softmax.default) and not node.args[2]:
        return node.args[0], node.args[1] % max(val(node).dim(), 1)
    if _op(node, aten.exp.default) and _op(node.args[0], aten._log_softmax.default) and not node.args[0].args[2]:
        inner = node.args[0]
        return inner.args[0], inner.args[1] % max(val(inner).dim(), 1)
    if not _op(node, aten.div.Tensor):
        return None
    e, total = node.args[:2]
    if not (_op(e, aten.exp.default) and _op(total, aten.sum.dim_IntList) and arg(total, 2, False)):
        return None
    dim = _one_dim(total.args[1], val(e).dim())
    if dim is None or not structure.same(total.args[0], e):
        return None
    return _shifted(e.args[0], dim, structure), dim


END = 2 ** 63 - 1


def _last_dim_slice(node: object) -> tuple[Node, object, object, object] | None:
    """(x, start, end, step) of a slice of x's last dim (end clipped to the size)."""
    if not _op(node, aten.slice.Tensor) or not isinstance(node.args[0], Node):
        return None
    x = node.args[0]
    rank = val(x).dim()
    args = [a.meta.get("val") if isinstance(a, Node) else a for a in node.args]    # sizes given as nodes
    args += [None] * (5 - len(args))
    dim, start, end, step = args[1] or 0, args[2] or 0, args[3], args[4] or 1
    if dim % rank != rank - 1:
        return None
    width = val(x).shape[-1]
    end = width if end is None or (isinstance(end, int) and end >= END // 2) else end
    return x, start, end, step


def halves(first: object, second: object) -> Node | None:
    """x when `first` and `second` are the first and second half of x's last dim (what canonical_form makes of
    a chunk or a two-way split)."""
    a, b = _last_dim_slice(first), _last_dim_slice(second)
    if a is None or b is None or a[0] is not b[0] or a[3] != 1 or b[3] != 1:
        return None
    x, width = a[0], val(a[0]).shape[-1]
    half = val(first).shape[-1]
    ok = a[1] == 0 and same_size(a[2], half) and same_size(b[1], half) and same_size(b[2], width) \
        and same_size(half * 2, width)
    return x if ok else None


def pairs(even: object, odd: object) -> Node | None:
    """x when `even` and `odd` are x[..., 0::2] and x[..., 1::2]."""
    a, b = _last_dim_slice(even), _last_dim_slice(odd)
    if a is None or b is None or a[0] is not b[0] or (a[1], b[1], a[3], b[3]) != (0, 1, 2, 2):
        return None
    width = val(a[0]).shape[-1]
    return a[0] if same_size(a[2], width) and same_size(b[2], width) else None


def pair_view_source(node: object) -> Node | None:
    """x when node is a view of x [..., D] as [..., D/2, 2] (the even/odd pairs of its last dim)."""
    if not _op(node, aten.view.default) and not _op(node, aten.reshape.default) \
            and not _op(node, aten._unsafe_view.default):
        return None
    if not isinstance(node.args[0], Node):
        return None
    x, v = val(node.args[0]), val(node)
    if v.dim() != x.dim() + 1 or not same_size(v.shape[-1], 2) or not same_size(v.shape[-2] * 2, x.shape[-1]):
        return None
    return node.args[0] if all(map(same_size, v.shape[:-2], x.shape[:-1])) else None

"""fuse_rms_norm: RMSNorm written out in ATen ops -> `ascend_dsa.rms_norm`.

Pattern, in canonical terms (anchored on the outermost product; canonical_form has made x² and pow(x, 2) a
product x·x, and canonical/reading.py reads 1/sqrt, pow(-0.5) and / sqrt as rsqrt and sum / D as a mean):
    n = Π {xf, rsqrt(mean(xf·xf, -1, keepdim=True) + eps), w...}
the factors in any order and association, the w (none, or several) over the last dim only (a weight, or an
expression of one such as Gemma's 1 + w); eps may be absent, a number, or the 0-dim tensor dynamic=True makes of
a float attribute (Dynamo is then asked to trace again with that float a constant, npu_graph.capture). The norm
must be computed in fp32 (xf is the fp32 input, or a bf16/fp16 input x cast to fp32): a norm computed in a
low-precision dtype is a near miss, because the op computes in fp32.
Without a weight factor, n's only use may be p = n · w.

The op computes x · rstd · gamma in fp32 and rounds once to x's dtype, so the rewrite follows the model's
casts exactly:
- every use of p is a cast back to x's dtype (weight before the cast: F.rms_norm, Gemma)
  -> the casts become rms_norm(x, w);
- every use of n is a cast back to x's dtype (cast back, then weight: Llama, DeepseekV3, the reference
  model, all in bf16) -> the casts become rms_norm(x, ones); the weight multiplication stays as written
  (folding it in would round once where the model rounds twice);
- otherwise p (or n) itself becomes rms_norm(xf, w or ones), whose result is fp32 like p: every fp32
  model, and low-precision models that keep using the fp32 value (a gated norm).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch._prims_common import is_contiguous_or_false

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.canonical.reading import divided_by_root, mean_of, rsqrt_of
from npu_graph.passes.canonical.structure import Structure
from npu_graph.passes.matching.fusion_graph import dim_arg, fuse_each
from npu_graph.passes.matching.match_util import NoMatch
from npu_graph.passes.matching.values import same_size, strip_casts, val

NAME = "fuse_rms_norm"
INFERENCE_ONLY = True
PATTERN = "x·rsqrt(mean(x²)+eps)"
PATTERN_WEIGHTED = "x·rsqrt(mean(x²)+eps)·w"

aten = torch.ops.aten
Node = torch.fx.Node
LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass
class Norm:
    """node = xf · rsqrt(mean(xf², -1, keepdim=True) + eps) · Π weights · Π extra (weights: factors over the last
    dim only; eps a number, or a 0-dim tensor that dynamic=True made of a float)."""

    node: Node
    xf: Node
    eps: float | Node
    weights: list[Node] = field(default_factory=list)
    chain: list[Node] = field(default_factory=list)     # the product nodes the norm's value is made of
    extra: list[Node] = field(default_factory=list)     # factors along other dims too (a gate): multiplied after


@dataclass
class Plan:
    """rms_norm(x, Π gamma (none: ones), eps)[0] replaces every node of `targets`; `end` is n or p."""

    x: Node
    gamma: list[Node]
    end: Node
    targets: list[Node]


@dataclass
class Product:
    """An elementwise product read in canonical terms: `factors` (nodes), `roots` (x of each rsqrt(x) factor, a
    division by sqrt(x) included) and `chain` (the product nodes opened up)."""

    factors: list[Node] = field(default_factory=list)
    roots: list[Node] = field(default_factory=list)
    chain: list[Node] = field(default_factory=list)


def product_factors(node: Node) -> Product:
    """The product `node` computes however it is associated: product nodes whose value feeds only this product
    (in the same dtype) are opened up."""
    found, pending = Product(), [node]
    while pending:
        current = pending.pop()
        inner = current is node or (len(current.users) == 1 and val(current).dtype == val(node).dtype)
        divided = divided_by_root(current) if inner else None
        root = rsqrt_of(current)
        if inner and current.target == aten.mul.Tensor and all(isinstance(a, Node) for a in current.args[:2]):
            found.chain.append(current)
            pending += list(current.args[1::-1])
        elif divided is not None:
            found.chain.append(current)
            pending.append(divided[0])
            found.roots.append(divided[1])
        elif root is not None:
            found.roots.append(root)
        else:
            found.factors.append(current)
    return found


def _mean_of_squares(s: Node, structure: Structure) -> tuple[Node, float | Node]:
    """(the squared tensor, eps) for s = mean(t · t, -1, keepdim=True) + eps."""
    eps: object = 0.0
    if s.target in (aten.add.Tensor, aten.add.Scalar) and s.kwargs.get("alpha", 1) == 1:
        s, eps = s.args if mean_of(s.args[0]) is not None else s.args[::-1]
    mean = mean_of(s)
    square = mean[0] if mean is not None else None
    if not (isinstance(square, Node) and square.target == aten.mul.Tensor and structure.same(*square.args[:2])):
        raise NoMatch("x·rsqrt(...) of something else than a mean of squares", near=mean is not None,
                      differs=f"mean({getattr(square, 'name', square)}) where the pattern has mean(x·x)")
    base, dims, keepdim = square.args[0], mean[1], mean[2]
    rank = val(base).dim()
    if len(dims) != 1 or dims[0] % rank != rank - 1 or not keepdim:
        raise NoMatch("the mean of squares is not over the last dim with keepdim=True")
    if isinstance(eps, Node):
        value = val(eps)
        if value is None or value.dim() != 0 or not value.dtype.is_floating_point:
            raise NoMatch("eps is a tensor with elements along some dim; rms_norm takes one number")
        return base, eps
    if not isinstance(eps, (int, float)) or eps < 0:
        raise NoMatch(f"eps {eps!r} is not a number >= 0")
    return base, float(eps)


def parse_norm(node: Node, structure: Structure | None = None) -> Norm:
    """The RMSNorm whose normalized (and weighted) value is `node`, or NoMatch (near once a mean of squares is
    seen)."""
    structure = structure or Structure(node.graph)
    product = product_factors(node) if node.target in (aten.mul.Tensor, aten.div.Tensor) else Product()
    if len(product.roots) != 1:
        raise NoMatch("not x·rsqrt(...)", near=False)
    base, eps = _mean_of_squares(product.roots[0], structure)
    xf = next((f for f in product.factors if structure.same(f, base)), None)
    if xf is None:
        raise NoMatch("the tensor normalized is not the one squared")
    xv, nv = val(xf), val(node)
    if xv.dim() != nv.dim() or not all(same_size(a, b) for a, b in zip(xv.shape, nv.shape)):
        raise NoMatch("the normalization broadcasts its input")
    if xv.dtype != torch.float32 or nv.dtype != torch.float32:
        raise NoMatch(f"the norm is computed in {nv.dtype}; rms_norm computes in float32")
    others = [f for f in product.factors if f is not xf]
    weights = [f for f in others if _over_last_dim(f, nv)]
    return Norm(node, xf, eps, weights, product.chain, [f for f in others if f not in weights])


def _dotted(user: Node, node: Node) -> bool:
    """`user` sums `node` over its last dim (the product is a dot product of the norm with a vector, which a later
    pass fuses with the norm as its key: the norm is the inner product, the vector is no weight of it)."""
    dims = user.args[1] if user.target == aten.sum.dim_IntList and len(user.args) > 1 else None
    rank = val(node).dim()
    return isinstance(dims, (list, tuple)) and any(d % rank == rank - 1 for d in dims)


def _over_last_dim(w: Node, like: torch.Tensor) -> bool:
    """w is a floating-point tensor along the last dim of `like` only (leading unit dims allowed)."""
    wv = val(w)
    if wv is None or not wv.dtype.is_floating_point or wv.dim() > like.dim():
        return False
    shape = list(wv.shape)
    while len(shape) > 1 and same_size(shape[0], 1):
        shape.pop(0)
    return len(shape) == 1 and same_size(shape[0], like.shape[-1])


def _weight(n: Node) -> tuple[Node, Node] | None:
    """(p, w) when n's only use is p = n · w in fp32 with w over the last dim only."""
    if len(n.users) != 1:
        return None
    p = next(iter(n.users))
    if p.target != aten.mul.Tensor or p.kwargs or not all(isinstance(a, Node) for a in p.args):
        return None
    w = p.args[1] if p.args[0] is n else p.args[0]
    pv = val(p)
    if w is n or pv is None or pv.dtype != torch.float32 or not _over_last_dim(w, val(n)):
        return None
    return p, w


def _casts_to(node: Node, dtype: torch.dtype) -> list[Node] | None:
    """The uses of `node`, when every one is a plain cast to `dtype`."""
    users = list(node.users)
    for user in users:
        uv = val(user)
        plain = user.kwargs.get("memory_format") in (None, torch.preserve_format)
        if user.target != aten._to_copy.default or uv is None or uv.dtype != dtype \
                or uv.device != val(node).device or not plain:
            return None
    return users or None


def _low_precision_input(xf: Node) -> Node | None:
    """x when xf is x (bf16/fp16) cast to fp32."""
    if xf.target != aten._to_copy.default or not isinstance(xf.args[0], Node):
        return None
    source = val(xf.args[0])
    ok = source is not None and source.dtype in LOW_PRECISION and source.device == val(xf).device
    return xf.args[0] if ok else None


def plan(norm: Norm) -> Plan:
    """Which nodes the op replaces, following where the model casts (see the module docstring)."""
    weighted = None if norm.weights or norm.extra else _weight(norm.node)
    options = ([(weighted[0], [weighted[1]])] if weighted else []) + [(norm.node, norm.weights)]
    low = _low_precision_input(norm.xf) if not norm.extra else None
    if low is not None:
        for end, gamma in options:
            casts = _casts_to(end, val(low).dtype)
            if casts:
                return Plan(low, gamma, end, casts)
    end, gamma = options[0]
    return Plan(norm.xf, gamma, end, [end])


def _gamma(graph: torch.fx.Graph, x: Node, weights: list[Node]) -> Node:
    """The weight as the op takes it ([D], x's dtype or fp32): the product of the weights, or ones."""
    xv = val(x)
    if not weights:
        size = dim_arg(graph, x, xv.dim() - 1)
        return graph.call_function(aten.ones.default, ([size],), {"dtype": xv.dtype, "device": xv.device})
    weight = weights[0]
    for other in weights[1:]:
        weight = graph.call_function(aten.mul.Tensor, (weight, other))
        weight.meta["val"] = val(weight.args[0]) * val(other)
    wv = val(weight)
    if wv.dim() != 1:
        weight = graph.call_function(aten.reshape.default, (weight, [-1]))
    if wv.dtype not in (xv.dtype, torch.float32):
        weight = graph.call_function(aten._to_copy.default, (weight,), {"dtype": torch.float32})
    return weight


def rewrite(gm: torch.fx.GraphModule, norm: Norm, chosen: Plan) -> None:
    graph = gm.graph
    with graph.inserting_before(chosen.end):
        gamma = _gamma(graph, chosen.x, chosen.gamma)
        fused = graph.call_function(torch.ops.ascend_dsa.rms_norm.default, (chosen.x, gamma, norm.eps))
        y = graph.call_function(operator.getitem, (fused, 0))
        for factor in norm.extra if chosen.end is norm.node else ():
            y = graph.call_function(aten.mul.Tensor, (y, factor))
    y.meta["val"] = chosen.targets[0].meta["val"]  # later matches in this run read it; refresh_meta redoes all
    for target in chosen.targets:
        target.replace_all_uses_with(y)


def _fuse(node: torch.fx.Node, gm: torch.fx.GraphModule, structure: Structure, ctx: PassContext,
          consumed: set[Node]) -> str:
    """Fuse the norm whose value `node` is (tried outermost product first; the products inside a fused norm are not
    tried again, and an inner product reports no near miss of its own)."""
    if node in consumed:
        raise NoMatch("part of a fused norm", near=False)
    if node.users and all(_dotted(user, node) for user in node.users):
        raise NoMatch("a product summed over the normalized dim: a dot product with the norm", near=False)
    try:
        norm = parse_norm(node, structure)
    except NoMatch as exc:
        users = list(node.users)
        inner = len(users) == 1 and users[0].target == aten.mul.Tensor and val(users[0]).dtype == val(node).dtype
        raise NoMatch(str(exc), exc.near and not inner, exc.canonical, exc.differs) from exc
    if isinstance(norm.eps, Node):
        ctx.ask_constant(gm, strip_casts(norm.eps))
        raise NoMatch("eps is a run-time tensor that is no float of the model's; rms_norm takes a number")
    chosen = plan(norm)
    if not is_contiguous_or_false(val(chosen.targets[0])):
        # the chain keeps its input's layout (a transposed x gives a transposed result, which a later view may rely
        # on); rms_norm writes a contiguous result
        raise NoMatch("the norm's result is not contiguous (its input's layout); rms_norm writes a contiguous one")
    rewrite(gm, norm, chosen)
    consumed.update(norm.chain)
    return PATTERN_WEIGHTED if chosen.gamma else PATTERN


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    structure, consumed = Structure(gm.graph), set()
    return fuse_each(gm, {aten.mul.Tensor, aten.div.Tensor}, lambda node: _fuse(node, gm, structure, ctx, consumed),
                     PATTERN, reverse=True)

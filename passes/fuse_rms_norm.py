"""fuse_rms_norm: RMSNorm written out in ATen ops -> `ascend_dsa.rms_norm`.

Pattern (anchored on the normalizing mul or div):
    n = xf · rsqrt(mean(xf², -1, keepdim=True) + eps)
where rsqrt may be written 1/sqrt, reciprocal(sqrt) or pow(-0.5), or n = xf / sqrt(...); xf² may be
pow(xf, 2) or xf·xf; eps may be absent. The norm must be computed in fp32 (xf is the fp32 input, or a
bf16/fp16 input x cast to fp32): a norm computed in a low-precision dtype is a near miss, because the op
computes in fp32; so is an eps that is a run-time tensor (what dynamic=True makes of a float attribute),
because the op takes a constant. Optionally n's only use is p = n · w, with w over the last dim only (a
weight, or an expression of one such as Gemma's 1 + w).

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
from dataclasses import dataclass

import torch
import torch.fx
from torch._prims_common import is_contiguous_or_false

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.matching.fusion_graph import dim_arg, fuse_each
from npu_graph.passes.matching.match_util import NoMatch
from npu_graph.passes.matching.values import arg, same_size, val

NAME = "fuse_rms_norm"
INFERENCE_ONLY = True
PATTERN = "x·rsqrt(mean(x²)+eps)"
PATTERN_WEIGHTED = "x·rsqrt(mean(x²)+eps)·w"

aten = torch.ops.aten
Node = torch.fx.Node
LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass
class Norm:
    """n = xf · rsqrt(mean(xf², -1, keepdim=True) + eps)."""

    node: Node
    xf: Node
    eps: float


@dataclass
class Plan:
    """rms_norm(x, gamma (None: ones), eps)[0] replaces every node of `targets`; `end` is n or p."""

    x: Node
    gamma: Node | None
    end: Node
    targets: list[Node]


def _inverse_sqrt_arg(node: object) -> Node | None:
    """s for rsqrt(s), reciprocal(sqrt(s)) and pow(s, -0.5)."""
    if not isinstance(node, Node):
        return None
    if node.target == aten.rsqrt.default:
        return node.args[0]
    if node.target == aten.reciprocal.default and getattr(node.args[0], "target", None) == aten.sqrt.default:
        return node.args[0].args[0]
    if node.target == aten.pow.Tensor_Scalar and node.args[1] == -0.5:
        return node.args[0]
    return None


def _split(node: Node) -> tuple[Node, Node] | None:
    """(xf, s) for n = xf · rsqrt(s) in any of its spellings, or n = xf / sqrt(s)."""
    args = node.args
    if node.target == aten.div.Tensor and getattr(args[1], "target", None) == aten.sqrt.default:
        return args[0], args[1].args[0]
    if node.target != aten.mul.Tensor or not all(isinstance(a, Node) for a in args[:2]):
        return None
    for a, b in (args[:2], args[1::-1]):
        s = _inverse_sqrt_arg(b)
        if s is not None:
            return a, s
    return None


def _squared(node: object) -> Node | None:
    if not isinstance(node, Node):
        return None
    if node.target == aten.pow.Tensor_Scalar and node.args[1] == 2:
        return node.args[0]
    if node.target == aten.mul.Tensor and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def _same_value(a: Node, b: Node) -> bool:
    """The same node, or the same cast of the same node (`x.float()` written twice)."""
    return a is b or (a.target == b.target == aten._to_copy.default and a.args == b.args
                      and a.kwargs == b.kwargs)


def _mean_of_squares(s: Node) -> tuple[Node, float]:
    """(the squared tensor, eps) for s = mean(t², -1, keepdim=True) + eps."""
    eps: object = 0.0
    if s.target in (aten.add.Tensor, aten.add.Scalar) and s.kwargs.get("alpha", 1) == 1:
        s, eps = s.args[0], s.args[1]
    base = _squared(s.args[0]) if isinstance(s, Node) and s.target == aten.mean.dim else None
    if base is None:
        raise NoMatch("not a mean of squares", near=False)
    if not isinstance(eps, (int, float)):
        raise NoMatch("eps is a run-time tensor (a float made symbolic by dynamic=True?); the op takes a constant")
    rank = val(base).dim()
    keepdim = arg(s, 2, False, "keepdim")
    if len(s.args[1]) != 1 or s.args[1][0] % rank != rank - 1 or not keepdim:
        raise NoMatch("the mean of squares is not over the last dim with keepdim=True")
    if eps < 0:
        raise NoMatch(f"negative eps {eps}")
    return base, float(eps)


def parse_norm(node: Node) -> Norm:
    """The RMSNorm whose normalized value is `node`, or NoMatch (near once a mean of squares is seen)."""
    split = _split(node) if node.op == "call_function" else None
    if split is None or not all(isinstance(a, Node) for a in split):
        raise NoMatch("not x·rsqrt(...)", near=False)
    xf, s = split
    base, eps = _mean_of_squares(s)
    if not _same_value(base, xf):
        raise NoMatch("the tensor normalized is not the one squared")
    xv, nv = val(xf), val(node)
    if xv.dim() != nv.dim() or not all(same_size(a, b) for a, b in zip(xv.shape, nv.shape)):
        raise NoMatch("the normalization broadcasts its input")
    if xv.dtype != torch.float32 or nv.dtype != torch.float32:
        raise NoMatch(f"the norm is computed in {nv.dtype}; rms_norm computes in float32")
    return Norm(node, xf, eps)


def _weight(n: Node) -> tuple[Node, Node] | None:
    """(p, w) when n's only use is p = n · w in fp32 with w over the last dim only."""
    if len(n.users) != 1:
        return None
    p = next(iter(n.users))
    if p.target != aten.mul.Tensor or p.kwargs or not all(isinstance(a, Node) for a in p.args):
        return None
    w = p.args[1] if p.args[0] is n else p.args[0]
    wv, nv, pv = val(w), val(n), val(p)
    if w is n or wv is None or pv is None or pv.dtype != torch.float32 or not wv.dtype.is_floating_point:
        return None
    shape = list(wv.shape)
    while len(shape) > 1 and same_size(shape[0], 1):
        shape.pop(0)
    if wv.dim() > nv.dim() or len(shape) != 1 or not same_size(shape[0], nv.shape[-1]):
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
    weighted = _weight(norm.node)
    options = ([weighted] if weighted else []) + [(norm.node, None)]
    low = _low_precision_input(norm.xf)
    if low is not None:
        for end, gamma in options:
            casts = _casts_to(end, val(low).dtype)
            if casts:
                return Plan(low, gamma, end, casts)
    end, gamma = options[0]
    return Plan(norm.xf, gamma, end, [end])


def _gamma(graph: torch.fx.Graph, x: Node, weight: Node | None) -> Node:
    """The weight as the op takes it ([D], x's dtype or fp32), or ones when the norm has none."""
    xv = val(x)
    if weight is None:
        size = dim_arg(graph, x, xv.dim() - 1)
        return graph.call_function(aten.ones.default, ([size],), {"dtype": xv.dtype, "device": xv.device})
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
    y.meta["val"] = chosen.targets[0].meta["val"]  # later matches in this run read it; refresh_meta redoes all
    for target in chosen.targets:
        target.replace_all_uses_with(y)


def _fuse(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    norm = parse_norm(node)
    chosen = plan(norm)
    if not is_contiguous_or_false(val(chosen.targets[0])):
        # the chain keeps its input's layout (a transposed x gives a transposed result, which a later view may rely
        # on); rms_norm writes a contiguous result
        raise NoMatch("the norm's result is not contiguous (its input's layout); rms_norm writes a contiguous one")
    rewrite(gm, norm, chosen)
    return PATTERN if chosen.gamma is None else PATTERN_WEIGHTED


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    return fuse_each(gm, {aten.mul.Tensor, aten.div.Tensor}, lambda node: _fuse(node, gm), PATTERN)

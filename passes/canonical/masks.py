"""The one mask form the fusion passes read: a score masked by masked_fill(m, -inf), where(m, x, -inf), where(m,
-inf, x) or an added float mask (in either operand order) is (score, Mask(kind, tensor)) with kind "visible" (a
bool tensor, True where a key is seen), "invisible" (True where it is hidden) or "additive" (0 or a very negative
value). `triangle` reads the structure of a mask built in the graph (tril / triu of ones, key and query
positions compared, their negations, an additive mask filled from one): "lower" where every query sees the keys
up to a diagonal (causal), "upper" where it sees the keys from a diagonal on (later keys: not causal), None where
the graph does not say (a mask given as an input: the fused ops check it at run time)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from npu_graph.passes.matching.values import NEGATIONS, VIEWS_AND_CASTS, fill_value, is_neg_inf, strip, val

aten = torch.ops.aten
Node = torch.fx.Node
_CONTRACTIONS = {aten.mm.default, aten.bmm.default, aten.sum.dim_IntList, aten.relu.default, aten._softmax.default,
                 aten.sigmoid.default, aten.addmm.default}
_REACH = 48   # how many nodes above a side of an add are looked at for a contraction


@dataclass
class Mask:
    """How a score tensor was masked: `tensor` is bool visible/invisible or an additive float mask."""

    kind: str  # "visible" | "invisible" | "additive"
    tensor: Node


def _computes(node: object) -> bool:
    """Whether a contraction (or an activation of one) is among the first _REACH nodes above `node`."""
    frontier, seen = [node] if isinstance(node, Node) else [], 0
    while frontier and seen < _REACH:
        current = frontier.pop()
        seen += 1
        if current.target in _CONTRACTIONS:
            return True
        frontier += current.all_input_nodes
    return False


def peel_mask(node: Node) -> tuple[Node, Mask | None]:
    """Score node without its mask, and the mask (masked_fill / where / additive) if there is one."""
    target, args = node.target, node.args
    if target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor) and is_neg_inf(args[2]):
        return args[0], Mask("invisible", args[1])
    if target == aten.where.self and is_neg_inf(args[2]):
        return args[1], Mask("visible", args[0])
    if target == aten.where.self and is_neg_inf(args[1]):
        return args[2], Mask("invisible", args[0])
    if target == aten.add.Tensor and all(isinstance(a, Node) for a in args[:2]) and node.kwargs.get("alpha", 1) == 1:
        score, mask = args[:2]
        if _computes(mask) and not _computes(score):
            score, mask = mask, score
        a, b = val(score), val(mask)
        if a is not None and b is not None and b.dtype.is_floating_point and b.dim() >= 2:
            return score, Mask("additive", mask)
    return node, None


def _flip(shape: str | None) -> str | None:
    return {"lower": "upper", "upper": "lower"}.get(shape) if shape else None


def _bool_triangle(node: object, depth: int = 0) -> str | None:
    """"lower" / "upper" for a bool tensor True on and below / above a diagonal of (query, key)."""
    node = strip(node, VIEWS_AND_CASTS)
    if not isinstance(node, Node) or depth > 8:
        return None
    if node.target in NEGATIONS:
        return _flip(_bool_triangle(node.args[0], depth + 1))
    if node.target in (aten.tril.default, aten.triu.default) and fill_value(node.args[0]) is not None:
        return "lower" if node.target == aten.tril.default else "upper"
    comparisons = {aten.le.Tensor: "lower", aten.lt.Tensor: "lower", aten.ge.Tensor: "upper", aten.gt.Tensor: "upper"}
    shape = comparisons.get(node.target)
    if shape is None:
        return None
    keys, queries = (_ramp_dim(a) for a in node.args[:2])     # key positions along the last dim on the left
    if keys == -1 and queries == -2:
        return shape
    if keys == -2 and queries == -1:
        return _flip(shape)
    return None


def _ramp_dim(node: object) -> int | None:
    """-1 / -2 when `node` is an arange laid along the last / second-to-last dim of a 2-d (or wider) view."""
    node = strip(node, frozenset({aten.slice.Tensor, aten.expand.default}))
    if not isinstance(node, Node) or node.target not in (aten.unsqueeze.default, aten.view.default):
        return None
    shape = list(val(node).shape)
    source = strip(node.args[0], frozenset({aten.slice.Tensor}))
    if not isinstance(source, Node) or source.target not in (aten.arange.default, aten.arange.start):
        return None
    sized = [i for i, s in enumerate(shape) if not (isinstance(s, int) and s == 1)]
    return sized[0] - len(shape) if len(sized) == 1 and sized[0] - len(shape) in (-1, -2) else None


def triangle(mask: Mask) -> str | None:
    """"lower" (causal), "upper" (later keys seen) or None (unknown) for the keys a mask lets each query see."""
    tensor = strip(mask.tensor, VIEWS_AND_CASTS)
    if mask.kind == "additive":
        if not isinstance(tensor, Node):
            return None
        if tensor.target in (aten.tril.default, aten.triu.default) and is_neg_inf(fill_value(tensor.args[0])):
            # a -inf filled triangle hides that triangle: triu(-inf) hides later keys (causal)
            return "lower" if tensor.target == aten.triu.default else "upper"
        if tensor.target == aten.masked_fill.Scalar and fill_value(tensor.args[0]) == 0:
            return _flip(_bool_triangle(tensor.args[1]))
        return None
    shape = _bool_triangle(mask.tensor)
    return shape if mask.kind == "visible" else _flip(shape)

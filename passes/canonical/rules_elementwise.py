"""Graph rules that give an elementwise function one ATen op where the spellings compute the same bits:
- relu: clamp_min(x, 0), clamp(x, min=0), threshold(x, 0, 0), maximum(x, zeros) -> relu(x);
- square: pow(x, 2) (x ** 2, square) -> x · x (ATen's pow computes x · x for the exponent 2);
- casts: prims.convert_element_type -> _to_copy; a round trip through a wider float type -> the value itself.
Each rule returns the replacement (built with an Emitter) or None. Spellings that round differently (rsqrt and
1/sqrt, a hand-written softmax) are read as one op by reading.py and stay as written in the graph.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

from npu_graph.passes.canonical.emit import Emitter
from npu_graph.passes.canonical.structure import Structure
from npu_graph.passes.matching.values import arg, fill_value, scalar, val

aten, prims = torch.ops.aten, torch.ops.prims
Node = torch.fx.Node
Rule = Callable[[Node, Structure, Emitter], "Node | None"]
EXACT_WIDENING = {(torch.float16, torch.float32), (torch.float16, torch.float64), (torch.bfloat16, torch.float32),
                  (torch.bfloat16, torch.float64), (torch.float32, torch.float64)}


def _op(node: object, target: object) -> bool:
    return isinstance(node, Node) and node.target == target


def relu(node: Node, s: Structure, emit: Emitter) -> Node | None:
    t, args = node.target, node.args
    if t == aten.clamp_min.default and scalar(args[1]) == 0:
        return emit(aten.relu.default, args[0])
    if t == aten.clamp.default and scalar(arg(node, 1, None, "min")) == 0 and arg(node, 2, None, "max") is None:
        return emit(aten.relu.default, args[0])
    if t == aten.threshold.default and scalar(args[1]) == 0 and scalar(args[2]) == 0:
        return emit(aten.relu.default, args[0])
    if t == aten.maximum.default:
        for x, zero in (args, args[::-1]):
            if isinstance(x, Node) and fill_value(zero) == 0 and val(x).shape == val(node).shape:
                return emit(aten.relu.default, x)
    return None


def casts(node: Node, s: Structure, emit: Emitter) -> Node | None:
    if node.target == prims.convert_element_type.default:
        return emit(aten._to_copy.default, node.args[0], dtype=node.args[1])
    inner = node.args[0]
    plain = set(node.kwargs) == {"dtype"} and _op(inner, aten._to_copy.default) and set(inner.kwargs) == {"dtype"}
    if plain and isinstance(inner.args[0], Node):
        source = val(inner.args[0])
        if source is not None and source.dtype == node.kwargs["dtype"] \
                and (source.dtype, inner.kwargs["dtype"]) in EXACT_WIDENING:
            return inner.args[0]
    return None


def square(node: Node, s: Structure, emit: Emitter) -> Node | None:
    if node.target == aten.pow.Tensor_Scalar and scalar(node.args[1]) == 2:
        return emit(aten.mul.Tensor, node.args[0], node.args[0])
    return None


RULES: dict[object, tuple[tuple[str, Rule], ...]] = {
    aten.clamp_min.default: (("relu", relu),),
    aten.clamp.default: (("relu", relu),),
    aten.threshold.default: (("relu", relu),),
    aten.maximum.default: (("relu", relu),),
    aten.pow.Tensor_Scalar: (("square", square),),
    prims.convert_element_type.default: (("cast", casts),),
    aten._to_copy.default: (("cast", casts),),
}

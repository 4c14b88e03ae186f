"""What a matcher asks about one node: its fake value, its arguments, constants it holds (zero, -inf), sizes
and dims, and the op sets it may step through (reshapes, unit dims, casts). One copy for every pass."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten

RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
UNIT_DIMS = frozenset({aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default})
CASTS = frozenset({aten._to_copy.default, aten.clone.default, aten.alias.default})
NEGATIONS = frozenset({aten.bitwise_not.default, aten.logical_not.default})   # on a bool mask, the same op
# Ops that keep every element's value and order (a row-major reshape, a unit dim, a broadcast or a copy):
# what a mask or a routing tensor may pass through on its way to the op that reads it.
VIEWS_AND_CASTS = RESHAPES | UNIT_DIMS | CASTS | {aten.expand.default}
_FILL_ARG = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2, aten.scalar_tensor.default: 0}
_ZEROS = {aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default}
_ONES = {aten.ones_like.default, aten.ones.default, aten.new_ones.default}


def val(node: Any) -> torch.Tensor | None:
    """The node's fake tensor, or None (not a node, no value, or not a tensor)."""
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def arg(node: torch.fx.Node, index: int, default: Any = None, name: str | None = None) -> Any:
    """The node's argument at `index`, else its keyword argument `name` (when given), else `default`."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default) if name is not None else default


def strip(node: Any, ops: frozenset | set) -> Any:
    """The first node below `node` (following first arguments) whose op is not in `ops`."""
    while isinstance(node, torch.fx.Node) and node.target in ops:
        node = node.args[0]
    return node


def strip_casts(node: Any) -> Any:
    return strip(node, CASTS)


def strip_views(node: Any) -> Any:
    return strip(node, VIEWS_AND_CASTS)


def scalar(value: object) -> float | None:
    """A Python number as a float (bools are not numbers here), else None."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def fill_value(value: object) -> float | None:
    """The number `value` is, or the one a factory node fills its tensor with (zeros, ones, full, full_like,
    new_full, scalar_tensor and their _like / new_ forms); None for anything else."""
    if not isinstance(value, torch.fx.Node):
        return scalar(value)
    if value.target in _ZEROS or value.target in _ONES:
        return 0.0 if value.target in _ZEROS else 1.0
    fill = _FILL_ARG.get(value.target)
    return scalar(value.args[fill]) if fill is not None else None


def is_zero(value: object) -> bool:
    return fill_value(value) == 0


def is_neg_inf(value: object) -> bool:
    """-inf (or a float at most -1e30, the masked value models use), or a node filled with it."""
    fill = fill_value(value)
    return fill is not None and fill <= -1e30


def is_last_dim(dim: object, of: int | torch.fx.Node) -> bool:
    """Is `dim` (negative or not) the last dim of a tensor of rank `of` (or of node `of`'s value)?"""
    rank = of if isinstance(of, int) else val(of).dim()
    return isinstance(dim, int) and rank > 0 and dim % rank == rank - 1


def same_size(a: object, b: object) -> bool:
    """Sizes known equal (ints, or symbolic sizes equal without adding a guard)."""
    return statically_known_true(a == b) if not (isinstance(a, int) and isinstance(b, int)) else a == b


def negated_bool(node: object) -> torch.fx.Node | None:
    """x when `node` is not(x) of a bool x (bitwise_not or logical_not: the same on bools), else None."""
    if not isinstance(node, torch.fx.Node) or node.target not in NEGATIONS:
        return None
    source = node.args[0]
    return source if getattr(val(source), "dtype", None) == torch.bool else None


_POSITIVE_OF_POSITIVE = frozenset({aten.sqrt.default, aten.rsqrt.default, aten.reciprocal.default, aten.exp.default,
                                   aten._to_copy.default, aten.clone.default, aten.pow.Tensor_Tensor,
                                   aten.pow.Tensor_Scalar})


def known_positive(node: Any, depth: int = 0) -> bool:
    """Whether a scalar value is > 0 by construction: a positive number, a size, a 0-dim tensor made of one, and
    roots, powers, reciprocals, exponentials, products and quotients of those (what a scale computed from a
    symbolic head dim is)."""
    if depth > 12:
        return False
    if isinstance(node, (torch.SymInt, torch.SymFloat)):
        return bool(node.node.expr.is_positive)
    if not isinstance(node, torch.fx.Node):
        number = scalar(node)
        return number is not None and number > 0
    if node.op == "placeholder":
        value = node.meta.get("val")
        return isinstance(value, (torch.SymInt, torch.SymFloat)) and bool(value.node.expr.is_positive)
    target = node.target
    if target == aten.scalar_tensor.default or target in _POSITIVE_OF_POSITIVE:
        return known_positive(node.args[0], depth + 1)
    if str(target) == "prims.convert_element_type.default":
        return known_positive(node.args[0], depth + 1)
    if target in (aten.mul.Tensor, aten.div.Tensor):
        return all(known_positive(a, depth + 1) for a in node.args[:2])
    return False

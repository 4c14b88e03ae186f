"""Structural keys of a graph's values (hash-consing, as e-graphs share equal terms): two nodes with one key
compute the same value: the same op on values with equal keys and the same constants. Placeholders are keyed by
position, seeded random ops by their own name. Keys order the operands of commutative ops (`sort_operands`), so
that `a * b` and `b * a` become one node text, and let rules see that two separately written subexpressions are
one value (a hand-written softmax computes exp(x - max) twice)."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._prims_common import is_contiguous_or_false

aten = torch.ops.aten
COMMUTATIVE = frozenset({aten.add.Tensor, aten.mul.Tensor, aten.maximum.default, aten.minimum.default,
                         aten.logical_and.default, aten.logical_or.default, aten.bitwise_and.Tensor,
                         aten.bitwise_or.Tensor, aten.eq.Tensor, aten.ne.Tensor})


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", str(value.node.expr))
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return value


class Structure:
    """Keys of the nodes of one graph, computed on demand (nodes a rule creates get theirs when first asked)."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.table: dict[Any, int] = {}
        self.keys: dict[torch.fx.Node, int] = {}
        self.placeholders = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}

    def key(self, node: torch.fx.Node) -> int:
        found = self.keys.get(node)
        if found is None:
            found = self.keys[node] = self.table.setdefault(self._shape(node), len(self.table))
        return found

    def _shape(self, node: torch.fx.Node) -> Any:
        if node.op == "placeholder":
            return ("input", self.placeholders.get(node, node.name))
        if node.op != "call_function" or torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            return ("unique", node.name)
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: ("node", self.key(n)))
        return (str(node.target), _hashable(args))

    def same(self, a: object, b: object) -> bool:
        """Whether two arguments are one value (equal nodes by key, equal constants)."""
        if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node):
            return a is b or self.key(a) == self.key(b)
        return not isinstance(a, torch.fx.Node) and not isinstance(b, torch.fx.Node) and a == b

    def order(self, node: torch.fx.Node) -> tuple[int, int]:
        """Sort key of an operand: tensors with elements along some dim first, 0-dim values last; then the key."""
        value = node.meta.get("val")
        scalar = isinstance(value, torch.Tensor) and value.dim() == 0
        return (int(scalar), self.key(node))


def _contiguous(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and is_contiguous_or_false(value)


def sort_operands(node: torch.fx.Node, structure: Structure) -> bool:
    """Put the two tensor operands of a commutative op in key order (exact: the op is commutative elementwise,
    broadcasting does not depend on the order, and contiguous operands give a contiguous result either way);
    True when they were swapped."""
    if node.target not in COMMUTATIVE or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return False
    a, b = node.args
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)) or not all(map(_contiguous, (a, b))):
        return False    # operands of other layouts could give the result another layout
    if structure.order(b) >= structure.order(a):
        return False
    node.args = (b, a)
    structure.keys.pop(node, None)
    return True

"""Canonical contractions over traced expressions (passes/matching/axis_trace.py): however a contraction was
spelled (einsum, matmul or @ with transposes, bmm over flattened dims, linear, broadcast multiply + sum, scales
anywhere), it reads as one

    Contraction: scale · Π scalars · Σ_{reduced} Π factors

over named axes. Products and sums open up into the contraction that contains them; a matmul is opened where it
is the expression itself, and stays one factor where it feeds another product (a projection inside a score stays
the projection). The constant scales of what was opened gather in `scale` (a factor that is not opened keeps its
own: its node's value includes it); 0-dim tensor factors (a scale computed from a symbolic size) go to
`scalars`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from npu_graph.passes.matching.axis_trace import Axis, Expr, Tracer, flat

_OPEN = ("mul", "sum")


@dataclass
class Contraction:
    node: torch.fx.Node | None
    factors: list[Expr] = field(default_factory=list)
    reduced: set[Axis] = field(default_factory=set)
    scale: float = 1.0
    scalars: list[torch.fx.Node] = field(default_factory=list)

    def reduced_ids(self) -> set[int]:
        return {id(a) for a in flat(list(self.reduced))}


def _scalar(tracer: Tracer, expr: Expr) -> bool:
    """A factor with no axes: a 0-dim tensor."""
    value = expr.node.meta.get("val") if expr.node is not None else None
    dims = tracer.memo[expr.node].dims if expr.node in tracer.memo else None
    return isinstance(value, torch.Tensor) and value.dim() == 0 and not any(dims or ())


def contraction(tracer: Tracer, expr: Expr) -> Contraction:
    """`expr` read as one canonical contraction (module docstring)."""
    found = Contraction(expr.node)
    pending = [(expr, True)]
    while pending:
        current, top = pending.pop()
        if current.kind in _OPEN or (top and current.kind == "matmul"):
            found.scale *= current.scale
            found.reduced |= set(current.reduced)
            pending += [(f, False) for f in reversed(current.factors)]
        elif current.kind == "leaf" and _scalar(tracer, current):
            found.scalars.append(current.node)
        else:
            found.factors.append(current)
    return found

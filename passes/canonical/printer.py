"""A canonical term as text, for near misses and `ascend-dsa inspect`: contractions as Σ over named axes of a
product, leaves by node name with their axes, elementwise functions by name. Axes are letters given in order of
first appearance (a, b, c...), sizes in the legend: "Σ[c] view_2[a,b,c]·relu(Σ[d] q[a,b,c,d]·k[a,e,d])"."""
from __future__ import annotations

import string

import torch

from npu_graph.passes.canonical.terms import contraction
from npu_graph.passes.matching.axis_trace import Axis, Expr, Tracer, flat

MAX_CHARS = 400


class Printer:
    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.names: dict[int, str] = {}
        self.sizes: dict[str, object] = {}

    def axis(self, axis: Axis) -> str:
        key = id(axis)
        if key not in self.names:
            n = len(self.names)
            letters = string.ascii_lowercase
            self.names[key] = letters[n % 26] + ("" if n < 26 else str(n // 26))
            self.sizes[self.names[key]] = axis.size
        return self.names[key]

    def axes(self, node: torch.fx.Node) -> str:
        value = self.tracer.memo.get(node)
        dims = value.dims if value is not None else []
        return ",".join("".join(self.axis(a) for a in flat(d)) for d in dims if d)

    def term(self, expr: Expr, depth: int = 0) -> str:
        if depth > 12:
            return "…"
        scale = "" if expr.scale == 1.0 else f"{expr.scale:.4g}·"
        if expr.kind in ("mul", "sum", "matmul"):
            return self.contraction(expr, depth)
        if expr.kind == "leaf":
            return f"{scale}{expr.node.name}[{self.axes(expr.node)}]"
        inner = ", ".join(self.term(f, depth + 1) for f in expr.factors)
        if expr.kind == "add":
            return f"{scale}({' + '.join(self.term(f, depth + 1) for f in expr.factors)})"
        name = expr.kind if expr.kind in ("relu", "softmax", "masked") else _op_name(expr.node)
        return f"{scale}{name}({inner})"

    def contraction(self, expr: Expr, depth: int) -> str:
        c = contraction(self.tracer, expr)
        reduced = "".join(self.axis(a) for a in flat(list(c.reduced)))
        parts = [f"{c.scale:.4g}"] if c.scale != 1.0 else []
        parts += [s.name for s in c.scalars] + [self.term(f, depth + 1) for f in c.factors]
        body = "·".join(parts) or "1"
        return f"Σ[{reduced}] {body}" if reduced else body

    def legend(self) -> str:
        return ", ".join(f"{name}={size}" for name, size in self.sizes.items())


def _op_name(node: torch.fx.Node | None) -> str:
    target = getattr(node, "target", None)
    return getattr(target, "_opname", None) or getattr(target, "__name__", str(target))


def canonical_text(tracer: Tracer, expr: Expr) -> str:
    """`expr` in canonical terms with its axis legend, cut to MAX_CHARS."""
    printer = Printer(tracer)
    text = printer.term(expr)
    text = f"{text}  ({printer.legend()})" if printer.sizes else text
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS - 1] + "…"

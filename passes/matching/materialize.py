"""Laying traced axes out as tensors again: the size of merged axes as a graph argument (`size_arg`) and the
nodes that arrange a leaf as the dims a fused op wants (`materialize`), symbolic sizes read at run time."""
from __future__ import annotations

import operator

import torch
import torch.fx

from npu_graph.passes.matching.axis_trace import Axis, Dim, TraceError, find, flat

aten = torch.ops.aten


def size_arg(graph: torch.fx.Graph, axes: tuple[Axis, ...] | list[Axis]) -> object:
    """The size of merged axes as a graph argument: an int, or nodes reading symbolic sizes at run time."""
    static, symbolic = 1, []
    for axis in axes:
        if isinstance(axis.size, int):
            static *= axis.size
            continue
        if axis.source is None:
            raise TraceError("symbolic size without a source tensor")
        symbolic.append(graph.call_function(aten.sym_size.int, axis.source))
    result: object = static
    for node in symbolic:
        result = node if result == 1 else graph.call_function(operator.mul, (result, node))
    return result


def materialize(graph: torch.fx.Graph, leaf: torch.fx.Node, leaf_dims: list[Dim], want: list[Dim]
                ) -> torch.fx.Node:
    """Emit nodes that lay out `leaf` as the dims `want` (each a tuple of the leaf's atomic axes; axes the
    leaf lacks become size-1 dims that are expanded). Call inside `graph.inserting_before(...)`."""
    roots = [a for d in leaf_dims for a in flat(d)]
    wanted = [a for d in want for a in flat(d) if a in roots]
    if sorted(map(id, wanted)) != sorted(map(id, roots)) or len(set(map(id, roots))) != len(roots):
        raise TraceError("layout does not use every axis of the leaf exactly once")
    node = graph.call_function(aten.reshape.default, (leaf, [size_arg(graph, [a]) for a in roots]))
    order = [roots.index(a) for a in wanted]
    if order != sorted(order):
        node = graph.call_function(aten.permute.default, (node, order))
    shape = [size_arg(graph, [a for a in flat(d) if a in roots]) for d in want]
    node = graph.call_function(aten.reshape.default, (node, shape))
    if any(a not in roots for d in want for a in flat(d)):
        full = [size_arg(graph, [_sourced(a) for a in flat(d)]) for d in want]
        node = graph.call_function(aten.expand.default, (node, full))
    return node


def _sourced(axis: Axis) -> Axis:
    """An axis with a size source: the axis itself, or the real axis it was unified with."""
    root = find(axis)
    return axis if axis.source is not None or isinstance(axis.size, int) else root

"""Graph rules for the pieces of a tensor and for selections, in one form each:
- halves: getitem(split(x, n, d), i) of a two-way split (chunk, split) -> slice(x, d, i·n, ...);
- even/odd values: the i-th of a [.., m, 2] view of the last dim (select, unbind) -> slice(x, -1, i, end, 2);
- top-k: the dim counted from the end when it is the last one, largest=True written out, sorted=True (an unsorted
  top-k may return its picks in any order, sorted is one of them).
Slices are views of the same elements as the pieces they replace (same strides and offsets).
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from npu_graph.passes.canonical.emit import Emitter
from npu_graph.passes.canonical.reading import pair_view_source
from npu_graph.passes.canonical.structure import Structure
from npu_graph.passes.matching.values import arg, is_last_dim, val

aten = torch.ops.aten
Node = torch.fx.Node
END = 2 ** 63 - 1


def _even_odd(emit: Emitter, x: Node, index: object) -> Node | None:
    if index not in (0, 1):
        return None
    return emit(aten.slice.Tensor, x, -1, index, END, 2)


def pieces(node: Node, s: Structure, emit: Emitter) -> Node | None:
    """getitem of a two-way split, or of unbind over a pair view; select of a pair view."""
    if node.target == aten.select.int:
        source = pair_view_source(node.args[0])
        rank = val(node.args[0]).dim()
        return _even_odd(emit, source, node.args[2]) if source is not None and is_last_dim(node.args[1], rank) \
            else None
    whole, index = node.args
    if not isinstance(whole, Node):
        return None
    if whole.target == aten.unbind.int:
        source = pair_view_source(whole.args[0])
        rank = val(whole.args[0]).dim()
        return _even_odd(emit, source, index) if source is not None and is_last_dim(arg(whole, 1, 0), rank) \
            else None
    two_way = len(whole.meta.get("val", ())) == 2 and index in (0, 1)
    if not two_way or whole.target not in (aten.split.Tensor, aten.split_with_sizes.default):
        return None
    x, size, dim = whole.args[0], whole.args[1], arg(whole, 2, 0)
    size = size[0] if isinstance(size, (list, tuple)) else size
    return emit(aten.slice.Tensor, x, dim, 0, size) if index == 0 else emit(aten.slice.Tensor, x, dim, size, END)


def topk_flags(node: Node, s: Structure, emit: Emitter) -> Node | None:
    x, k = node.args[:2]
    rank = val(x).dim()
    dim, largest = arg(node, 2, -1, "dim"), arg(node, 3, True, "largest")
    if (node.args[2:] == (-1, True, True) and not node.kwargs) or not is_last_dim(dim, rank) or not largest:
        return None
    return emit(aten.topk.default, x, k, -1, True, True)


RULES = {
    aten.select.int: (("pieces", pieces),),
    operator.getitem: (("pieces", pieces),),
    aten.topk.default: (("topk_flags", topk_flags),),
}

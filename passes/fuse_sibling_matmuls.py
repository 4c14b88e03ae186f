"""fuse_sibling_matmuls: products of one decode row with several weights become one product.

A decoder layer multiplies the same activation by several weights: DeepSeek-V3.2's q_a / kv_a / indexer wk /
weights_proj read one normalised hidden state, a MLP's gate and up projections one input, Kimi Linear's q / k /
v / g / beta projections one. At decode size each product is a few microseconds of math behind a call that
costs more (a tiny DeepSeek-V3.2 decode step: 22 products, 12 distinct inputs). Where the target realised its
weights pre-transposed (layout_nz: `mm(x, clone(t(w)))`, w a parameter), products of one row (x is [1, K])
with weights of one dtype become `mm(x, cat([t(w1), t(w2), ...], 1))` and a column slice per original product.
The concatenated weight reads parameters only, so the parameter prologue builds it once per parameter version
(npu_graph.runtime.hoist), in place of the separate pre-transposed copies. A slice of one row is contiguous, so
every consumer sees the layout it saw before. Each output column is the same dot product over K as before.
Runs after eliminate_common_subexpressions, which gives the siblings one input node.
"""
from __future__ import annotations

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.matching.values import val

NAME = "fuse_sibling_matmuls"
INFERENCE_ONLY = True

aten = torch.ops.aten


def _weight(node: torch.fx.Node, params: set[torch.fx.Node]) -> torch.fx.Node | None:
    """The parameter w of `mm(x, clone(t(w)))` (layout_nz's pre-transposed weight), else None."""
    packed = node.args[1]
    if not (isinstance(packed, torch.fx.Node) and packed.target is aten.clone.default):
        return None
    t = packed.args[0]
    if not (isinstance(t, torch.fx.Node) and t.target is aten.t.default and t.args[0] in params):
        return None
    return t.args[0]


def _groups(gm: torch.fx.GraphModule, params: set[torch.fx.Node]
            ) -> list[list[tuple[torch.fx.Node, torch.fx.Node]]]:
    """[(mm, weight), ...] per input row read by two or more pre-transposed products of one weight dtype."""
    found: dict[tuple[torch.fx.Node, torch.dtype], list[tuple[torch.fx.Node, torch.fx.Node]]] = {}
    for node in gm.graph.find_nodes(op="call_function", target=aten.mm.default):
        x, weight = node.args[0], _weight(node, params)
        shape = val(x).shape if val(x) is not None else None
        if weight is None or shape is None or len(shape) != 2 or not isinstance(shape[0], int) or shape[0] != 1:
            continue
        found.setdefault((x, val(weight).dtype), []).append((node, weight))
    return [group for group in found.values() if len(group) > 1]


def _fuse(gm: torch.fx.GraphModule, group: list[tuple[torch.fx.Node, torch.fx.Node]]) -> None:
    graph, x = gm.graph, group[0][0].args[0]
    with graph.inserting_before(group[0][0]):
        columns = []
        for _, weight in group:
            columns.append(graph.call_function(aten.t.default, (weight,)))
            columns[-1].meta["val"] = val(weight).t()
        stacked = graph.call_function(aten.cat.default, (columns, 1))
        stacked.meta["val"] = torch.cat([val(c) for c in columns], 1)
        product = graph.call_function(aten.mm.default, (x, stacked))
        product.meta["val"] = val(x) @ val(stacked)
        parts, start = [], 0
        for _, weight in group:
            end = start + val(weight).shape[0]
            parts.append(graph.call_function(aten.slice.Tensor, (product, 1, start, end)))
            view = val(product)[:, start:end]           # its layout, as a tensor of its own (the glue worker's
            parts[-1].meta["val"] = view.new_empty_strided(view.shape, view.stride())    # pickler takes no views)
            start = end
    for (node, _), part in zip(group, parts):       # after the inserts: they were placed before group[0][0]
        node.replace_all_uses_with(part)
        packed = node.args[1]
        graph.erase_node(node)
        _erase_unused(graph, packed)


def _erase_unused(graph: torch.fx.Graph, packed: torch.fx.Node) -> None:
    """The separate pre-transposed copy `clone(t(w))` and its `t`, where nothing else reads them."""
    for node in (packed, packed.args[0]):
        if not node.users:
            graph.erase_node(node)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    params = ctx.param_placeholders(gm)
    groups = _groups(gm, params)
    for group in groups:
        _fuse(gm, group)
    if groups:
        gm.recompile()
    products = sum(len(group) for group in groups)
    return PassResult(changed=bool(groups), stats={"groups": len(groups), "products": products,
                                                   "calls_saved": products - len(groups)})

"""Chains of views in the Python glue become one call each: a view of the tensor the chain starts from.

A decode step's glue is mostly views (the tiny DeepSeek-V3.2's: ~120 of ~190 ATen calls are view, reshape,
slice, unsqueeze, split, transpose), often several in a row on one tensor (`reshape → reshape → bmm → reshape →
view → transpose → view`). Each is a Python call of its own (~1.5-4 µs, three to six times that inside a step,
where the step's code and data are cold). Where the traced layout of a view and of the tensor its chain starts
from (its root: the first value up the chain that is not a view) are static, the view is
`_reinterpret_tensor(root, sizes, strides, offset)` — Inductor's own `reinterpret_tensor`: sizes and strides as
traced, the storage offset relative to the root's (so a root that is itself a view of another storage offset is
served too). One call per view that is used outside the chain; the views in between are dead and go.

The roots' layouts at run time are those traced: a graph input's sizes and strides are Dynamo's guards, and an
op's output has the layout its meta function gave (what Inductor relies on too). Left as they are: views with a
symbolic size, stride or offset (a decode graph's cache length), views the graph returns (AOT autograd rebuilds
returned aliases of inputs from their view chain), and every view of a tensor that an in-place op writes to,
directly or through a view (the tensor reinterpret_tensor makes shares its root's storage but not its version
counter, which the runtime reads to know when a parameter changed).

Measured on the 2-core EPYC VM (AVX2), transformers' tiny configs with the Python glue, `generate()` of 32 tokens
(three graphs, one process, alternated): deepseek_v32 74.5 -> 63.0 ms (107-112 views replaced per graph),
kimi_linear 61.5 -> 53.3 ms.
"""
from __future__ import annotations

import operator

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from npu_graph.passes.streams import deps

reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor

_aten = torch.ops.aten
# ATen overloads whose result is always a view of their first argument
VIEW_OPS = frozenset({
    _aten.view.default, _aten._unsafe_view.default, _aten.unsqueeze.default, _aten.squeeze.dim,
    _aten.squeeze.dims, _aten.squeeze.default, _aten.slice.Tensor, _aten.select.int, _aten.transpose.int,
    _aten.permute.default, _aten.t.default, _aten.expand.default, _aten.alias.default, _aten.narrow.default,
    _aten.diagonal.default, _aten.unfold.default, _aten.as_strided.default,
})
# overloads that return a list of views of their first argument (read with getitem)
SPLIT_OPS = frozenset({_aten.split_with_sizes.default, _aten.split.Tensor, _aten.unbind.int, _aten.chunk.default})
# reshape is a view when its traced result shares its input's storage (else it copies)
MAYBE_VIEW_OPS = frozenset({_aten.reshape.default})


def _static_layout(value: object) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """(sizes, strides, storage offset) of a fake tensor when all are concrete ints, else None."""
    if not isinstance(value, torch.Tensor) or value.layout is not torch.strided:
        return None
    layout = (tuple(value.shape), tuple(value.stride()), value.storage_offset())
    if all(is_concrete_int(x) for part in layout[:2] for x in part) and is_concrete_int(layout[2]):
        return tuple(map(int, layout[0])), tuple(map(int, layout[1])), int(layout[2])
    return None


def _same_storage(a: object, b: object) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.untyped_storage()._cdata == b.untyped_storage()._cdata)


def _view_input(node: torch.fx.Node, constant_only: bool = True) -> torch.fx.Node | None:
    """The tensor node `node` is a view of (its first argument; a split's input for a getitem of a split), or
    None when `node` is not a view op (with constant arguments besides that input, unless not `constant_only`).
    Narrower than passes.streams.deps.root's walk (any op returning an alias): these are the views it replays."""
    if node.op != "call_function":
        return None
    call = node
    if node.target is operator.getitem:
        call = node.args[0]
        if not (isinstance(call, torch.fx.Node) and call.op == "call_function" and call.target in SPLIT_OPS):
            return None
    elif node.target not in VIEW_OPS and node.target not in MAYBE_VIEW_OPS:
        return None
    source, *rest = call.args
    if not isinstance(source, torch.fx.Node) or (constant_only and _has_nodes(rest, call.kwargs)):
        return None
    return source


def _has_nodes(args: object, kwargs: dict) -> bool:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((args, kwargs), found.append)
    return bool(found)


def _derived(node: torch.fx.Node, source: object) -> object:
    """node's value computed from its input's value `source` (fake tensors: layouts only). The traced value of a
    view a pass made may not record its storage offset; this one does."""
    if node.target is operator.getitem:
        call = node.args[0]
        return call.target(source, *call.args[1:], **call.kwargs)[node.args[1]]
    return node.target(source, *node.args[1:], **node.kwargs)


def collapse(gm: torch.fx.GraphModule) -> int:
    """Replace each view whose chain has static layouts with one reinterpret_tensor of its root (module
    docstring); returns how many views were replaced. Views that are then unused are removed."""
    graph, replaced = gm.graph, 0
    outputs: set[torch.fx.Node] = set()
    for node in graph.find_nodes(op="output"):
        torch.fx.node.map_arg(node.args, outputs.add)
    written = {root for node in graph.nodes for root in deps.written_roots(node)}    # storages in-place ops write
    chains: dict[torch.fx.Node, tuple[torch.fx.Node, FakeTensor]] = {}     # view -> (root, its value from root's)
    for node in list(graph.nodes):
        source = _view_input(node)
        if source is None:
            continue
        if source in chains:
            root, source_value = chains[source]
        elif _view_input(source, constant_only=False) is None:
            root, source_value = source, source.meta.get("val")
        else:                       # a view left as it is: so are the views of it
            continue
        if deps.root(root) in written or not isinstance(source_value, FakeTensor) \
                or _static_layout(source_value) is None:
            continue
        try:
            with source_value.fake_mode:
                value = _derived(node, source_value)
        except Exception:           # a view the fake tensors cannot replay: left as it is
            continue
        if _static_layout(value) is not None and _same_storage(value, source_value):
            chains[node] = (root, value)
    for node, (root, value) in chains.items():
        if node not in outputs and node.users:
            _replace(graph, node, root, value)
            replaced += 1
    graph.eliminate_dead_code()
    gm.recompile()
    return replaced


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, root: torch.fx.Node, value: FakeTensor) -> None:
    """node becomes reinterpret_tensor(root, ...) under its own name (the dump reads as the graph did)."""
    sizes, strides, offset = _static_layout(value)
    with graph.inserting_before(node):
        new = graph.call_function(reinterpret_tensor, (root, sizes, strides,
                                                       offset - root.meta["val"].storage_offset()))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    name = node.name
    graph.erase_node(node)
    new._rename(name)

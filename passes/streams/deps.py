"""What must run before what: data edges plus the ordering that in-place writes impose.

A node depends on its inputs, and on buffers: a write to a buffer (an input of an op whose schema marks it
written, e.g. `index_put_` on a KV cache) waits for every earlier reader and writer of that buffer, and every
later reader waits for the write. A buffer is named by its root: the node a chain of views and in-place
results leads back to (usually a graph input). Other side-effect nodes keep their relative order; stream
event nodes (npu_graph.runtime.streams) are left out.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from npu_graph.runtime.streams import EVENT_OPS


def _returns_alias(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def _alias_source(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose storage `node` is (a view, an in-place result, an item of a list of views)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    aliased = node.args[0] if node.target is operator.getitem else node
    return node.args[0] if _returns_alias(aliased) else None


def root(node: torch.fx.Node) -> torch.fx.Node:
    """The node owning the storage `node` reads: follows views, in-place results and their tuple items."""
    source = _alias_source(node)
    while source is not None:
        node, source = source, _alias_source(source)
    return node


def written_roots(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Roots of the arguments this node writes in place (from its schema's alias annotations)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    found = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, torch.fx.Node):
            found.append(root(value))
    return found


def dependencies(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """For every call_function node, the nodes that must complete before it (inputs first, then ordering)."""
    deps: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    readers: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    writer: dict[torch.fx.Node, torch.fx.Node] = {}
    last_effect = None
    for node in graph.nodes:
        if node.op != "call_function" or node.target in EVENT_OPS:
            continue
        found = dict.fromkeys(node.all_input_nodes)
        read = {root(a) for a in node.all_input_nodes}
        found.update(dict.fromkeys(writer[r] for r in read if r in writer))
        writes = written_roots(node)
        for r in writes:
            found.update(dict.fromkeys(readers.get(r, [])))
        if node.is_impure() and not writes:
            if last_effect is not None:
                found[last_effect] = None
            last_effect = node
        found.pop(node, None)
        deps[node] = list(found)
        for r in read:
            readers.setdefault(r, []).append(node)
        for r in writes:
            writer[r] = node
            readers[r] = []
    return deps

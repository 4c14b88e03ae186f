"""eliminate_common_subexpressions: compute each pure ATen / fused-op expression once.

Captured graphs repeat work per layer that only depends on the graph's inputs: the block table cast to int64
once per paged read, the same `unsqueeze(positions, -1)` six times for the rotary tables, the same cosine
table for the query and the key. Two nodes with the same operator and the same arguments (the same input
nodes, equal constants) give the same result, so the later one is replaced by the earlier one, except where
that is not true or not safe:
- the operator writes one of its arguments in place, is random, or is not an ATen / fused operator (stream
  events, Python calls);
- an input aliases a tensor that the graph writes in place (a cache buffer written between the two reads), or
  the node's own result is written in place later (two `empty` buffers filled separately stay two), or is
  returned by the graph (two freshly made cache buffers the caller fills later must stay two tensors).
Aliasing is followed through view operators (their schema returns an alias of the input) and tuple access.
"""
from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult

NAME = "eliminate_common_subexpressions"
INFERENCE_ONLY = False


def _schema(node: torch.fx.Node) -> torch._C.FunctionSchema | None:
    target = node.target
    return target._schema if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) else None


def _returns_alias(node: torch.fx.Node) -> bool:
    schema = _schema(node)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def alias_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage `node` views: followed through view operators and tuple access of their results."""
    while node.args and isinstance(node.args[0], torch.fx.Node) and (
            _returns_alias(node) or (node.op == "call_function" and node.target is operator.getitem)):
        node = node.args[0]
    return node


def _written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    schema = _schema(node)
    if schema is None:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        written += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.fx.Node)]
    return written


def written_or_returned_roots(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Alias roots of every tensor some node writes in place or the graph returns."""
    roots = {alias_root(arg) for node in graph.nodes for arg in _written_args(node)}
    outputs = [n for n in graph.nodes if n.op == "output"]
    return roots | {alias_root(arg) for out in outputs for arg in out.all_input_nodes}


def _pure(node: torch.fx.Node) -> bool:
    schema = _schema(node)
    return (schema is not None and not schema.is_mutable and torch.Tag.nondeterministic_seeded not in node.target.tags
            and not node.target._schema.name.startswith("aten::_local_scalar"))


def _key(value: Any) -> Any:
    """A hashable form of an argument (nodes by identity, containers element-wise, constants by type and value)."""
    if isinstance(value, torch.fx.Node):
        return ("node", id(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    return (type(value).__name__, repr(value))


def _inputs_stable(node: torch.fx.Node, written: set[torch.fx.Node]) -> bool:
    return node not in written and all(alias_root(n) not in written for n in node.all_input_nodes)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    written = written_or_returned_roots(gm.graph)
    seen: dict[Any, torch.fx.Node] = {}
    counts: Counter[str] = Counter()
    for node in list(gm.graph.nodes):
        if not _pure(node) or not _inputs_stable(node, written) or alias_root(node) in written:
            continue
        key = (node.target, _key(node.args), _key(node.kwargs))
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
            counts[node.target._opname] += 1
    stats = {"merged": sum(counts.values()), **dict(counts.most_common())} if counts else {}
    return PassResult(changed=bool(counts), stats=stats)

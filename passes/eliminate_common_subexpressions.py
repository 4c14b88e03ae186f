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
from npu_graph.passes.streams.deps import root, written_roots

NAME = "eliminate_common_subexpressions"
INFERENCE_ONLY = False


def _schema(node: torch.fx.Node) -> torch._C.FunctionSchema | None:
    target = node.target
    return target._schema if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) else None


def written_or_returned_roots(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Storage roots (streams/deps.py root: through views, in-place results and their tuple items) of every tensor
    some node writes in place or the graph returns."""
    roots = {r for node in graph.nodes for r in written_roots(node)}
    outputs = [n for n in graph.nodes if n.op == "output"]
    return roots | {root(arg) for out in outputs for arg in out.all_input_nodes}


def _result_stable(node: torch.fx.Node, written: set[torch.fx.Node]) -> bool:
    """Neither the node's storage nor, for a tuple of fresh tensors, any item of it is written or returned."""
    items = [u for u in node.users if u.target is operator.getitem]
    return root(node) not in written and not any(u in written for u in items)


def _pure(node: torch.fx.Node) -> bool:
    schema = _schema(node)
    return (schema is not None and not schema.is_mutable and torch.Tag.nondeterministic_seeded not in node.target.tags
            and not node.target._schema.name.startswith("aten::_local_scalar"))


def _key(value: Any) -> Any:
    """A hashable form of an argument (nodes by identity, containers element-wise, constants by type and value). A
    node computing a symbolic int is keyed by its expression: `sym_size` of two tensors with the same symbolic
    size is the same int, so the reshapes and masks built from either are the same, and the later node itself is
    replaced by the first that computes the int (a size read from a tensor that nothing else needs no longer
    keeps that tensor's computation alive)."""
    if isinstance(value, torch.fx.Node):
        val = value.meta.get("val")
        return ("sym", str(val.node.expr)) if isinstance(val, torch.SymInt) else ("node", id(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    return (type(value).__name__, repr(value))


def _inputs_stable(node: torch.fx.Node, written: set[torch.fx.Node]) -> bool:
    return all(root(n) not in written for n in node.all_input_nodes)


def _merge(gm: torch.fx.GraphModule, node: torch.fx.Node, first: torch.fx.Node, counts: Counter[str]) -> None:
    node.replace_all_uses_with(first)
    gm.graph.erase_node(node)
    counts[getattr(node.target, "_opname", getattr(node.target, "__name__", str(node.target)))] += 1


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    written = written_or_returned_roots(gm.graph)
    seen: dict[Any, torch.fx.Node] = {}
    counts: Counter[str] = Counter()
    for node in list(gm.graph.nodes):
        if isinstance(node.meta.get("val"), torch.SymInt):
            first = seen.setdefault(_key(node), node)
            if first is not node and node.op == "call_function" and (_pure(node) or _schema(node) is None):
                _merge(gm, node, first, counts)
            continue
        if not _pure(node) or not _inputs_stable(node, written) or not _result_stable(node, written):
            continue
        key = (node.target, _key(node.args), _key(node.kwargs))
        first = seen.setdefault(key, node)
        if first is not node:
            _merge(gm, node, first, counts)
    stats = {"merged": sum(counts.values()), **dict(counts.most_common())} if counts else {}
    return PassResult(changed=bool(counts), stats=stats)

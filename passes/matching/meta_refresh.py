"""Recomputing node.meta["val"] after a pass rewrote part of a graph, so that later passes see correct fake
tensors — only for the nodes the rewrite can have changed.

A full fake-tensor propagation of a decoder graph costs about a second, and every fusion pass that matched
used to run one (most of a compile's pass time). `refresh_meta(gm, since=snapshot)` recomputes a node only
when it is new, when its inputs differ from what the snapshot recorded (another node, or the same node with
another shape, stride, dtype, device or offset), or when one of its inputs was recomputed and the node may
alias it (a view, an in-place op, a getitem of a tuple, anything that is not a functional ATen overload);
every other node keeps its value. Without a snapshot every node is recomputed.

`refresh_aliases(replaced)` is the cheaper refresh for a rewrite that gave nodes' users replacements of the same
type (dtype, device, shape, strides): the users' values stay right, except those that may share their input's
storage (views, getitems), which are recomputed with what they alias, transitively.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.fx.node import map_aggregate
from torch.fx.passes.fake_tensor_prop import FakeTensorProp


def _value_signature(value: Any) -> Any:
    """What a fake value's consumers can depend on, comparable without touching the shape environment
    (symbolic sizes are compared by their sympy expression, which adds no guard; printing it, as before, cost a
    tiny DeepSeek-V3.2's symbolic decode graph ~2 s of its passes)."""
    def size(s: Any) -> Any:
        return s if isinstance(s, int) else s.node.expr

    if isinstance(value, torch.Tensor):
        return (tuple(map(size, value.shape)), tuple(map(size, value.stride())), value.dtype, value.device,
                size(value.storage_offset()))
    if isinstance(value, (list, tuple)):
        return tuple(_value_signature(v) for v in value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.expr
    return value if isinstance(value, (int, float, bool, type(None))) else type(value).__name__


class _Signatures(dict):
    """_value_signature of each value met, by the value's identity (the value is held, so its id stays its own): a
    node's value is read once, however many consumers it has."""

    def of(self, value: Any) -> Any:
        held = self.get(id(value))
        if held is None or held[0] is not value:
            held = self[id(value)] = (value, _value_signature(value))
        return held[1]


def _inputs_signature(node: torch.fx.Node, signatures: _Signatures) -> Any:
    """The node's arguments with each input node replaced by (its identity, its value's signature)."""
    def of(arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):
            return ("node", id(arg), signatures.of(arg.meta.get("val")))
        return arg

    return map_aggregate((node.args, node.kwargs), of)


def meta_snapshot(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, Any]:
    """Each node's inputs as they are before a rewrite (take it before the pass changes the graph)."""
    signatures = _Signatures()
    return {node: _inputs_signature(node, signatures) for node in gm.graph.nodes}


def _may_alias_inputs(node: torch.fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return True
    schema = target._schema
    return schema.is_mutable or any(r.alias_info is not None for r in schema.returns)


class _IncrementalProp(FakeTensorProp):
    """FakeTensorProp that keeps the values of nodes a rewrite cannot have changed."""

    def __init__(self, gm: torch.fx.GraphModule, mode: Any, since: dict[torch.fx.Node, Any]) -> None:
        super().__init__(gm, mode=mode)
        self.since = since
        self.recomputed: set[torch.fx.Node] = set()
        self.signatures = _Signatures()

    def _unchanged(self, node: torch.fx.Node) -> bool:
        if node not in self.since or "val" not in node.meta:
            return False
        try:
            same = bool(self.since[node] == _inputs_signature(node, self.signatures))
        except Exception:  # an argument whose == is not a plain bool: recompute rather than guess
            return False
        return same and not (_may_alias_inputs(node) and any(a in self.recomputed for a in node.all_input_nodes))

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op in ("call_function", "call_method", "call_module"):  # placeholders, attributes: same objects
            if self._unchanged(n):
                return n.meta["val"]
            self.recomputed.add(n)
        return super().run_node(n)


def refresh_aliases(replacements: list[torch.fx.Node]) -> None:
    """Recompute the values of the nodes that may alias a replacement's value (each now reads the replacement, of
    the same type as the node it replaced), and of the nodes that may alias those, in graph order."""
    pending, found = [u for r in replacements for u in r.users], set()
    while pending:
        node = pending.pop()
        if node in found or node.op != "call_function" or not _may_alias_inputs(node):
            continue
        found.add(node)
        pending += node.users
    if not found:
        return
    order = {n: i for i, n in enumerate(next(iter(found)).graph.nodes)}
    for node in sorted(found, key=order.__getitem__):     # fake tensors dispatch in their own mode
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        node.meta["val"] = node.target(*args, **kwargs)


def refresh_meta(gm: torch.fx.GraphModule, since: dict[torch.fx.Node, Any] | None = None) -> None:
    """Recompute the fake values a rewrite changed (all of them without `since`, a `meta_snapshot` taken
    before the rewrite), from the placeholders' values (symbolic sizes preserved)."""
    inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = torch._guards.detect_fake_mode([i for i in inputs if isinstance(i, torch.Tensor)])
    gm.recompile()
    prop = FakeTensorProp(gm, mode=fake_mode) if since is None else _IncrementalProp(gm, fake_mode, since)
    prop.propagate_dont_convert_inputs(*inputs)

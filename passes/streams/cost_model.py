"""Cost model for stream scheduling: modeled run time of one graph node on a device profile.

A node costs `launch + max(flops / peak, bytes / bandwidth)`; FLOPs and bytes come from the fake tensors in
node.meta["val"] (symbolic sizes use their hints). Views, tuple access and size arithmetic cost nothing.
`event` is the cost of one cross-stream record/wait pair, paid by the waiting node.

The profile comes with the target's description (PassContext.machine.cost; npu_graph.targets.description).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from npu_graph.pass_api import DeviceProfile

aten = torch.ops.aten
_MATMUL = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_VIEWS = {aten._unsafe_view.default, aten.alias.default}
_GATHERS = {aten.embedding.default, aten.index.Tensor, aten.gather.default, aten.index_select.default}


def _size(value: Any) -> int:
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return int(hint) if hint is not None else 64
    return int(value)


def numel(value: Any) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    count = 1
    for size in value.shape:
        count *= _size(size)
    return count


def nbytes(value: Any) -> int:
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    return numel(value) * value.element_size() if isinstance(value, torch.Tensor) else 0


def is_free(node: torch.fx.Node) -> bool:
    """Nodes that launch nothing: views, tuple access, size arithmetic."""
    if node.op != "call_function":
        return True
    if node.target in _VIEWS:
        return True
    if node.target is operator.getitem or not isinstance(node.target, torch._ops.OpOverload):
        return not isinstance(node.meta.get("val"), torch.Tensor) or node.target is operator.getitem
    schema = node.target._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    if schema.returns and all(r.alias_info is not None for r in schema.returns):
        return True
    return not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list))


def _val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


def _shape(arg: Any) -> list[int]:
    value = _val(arg)
    return [_size(s) for s in value.shape] if isinstance(value, torch.Tensor) else []


def node_flops(node: torch.fx.Node) -> float:
    """Multiply-adds x 2 for matmuls and the attention-like fused ops; one per output element otherwise."""
    target, args = node.target, node.args
    if target in _MATMUL:
        a, b = _shape(args[-2]), _shape(args[-1])
        return 2.0 * numel(_val(args[-2])) * (b[-1] if b else 1) if a else 0.0
    name = getattr(target, "_opname", "")
    if name == "lightning_indexer":
        k = _shape(args[1])
        keys = k[0] * k[1] if len(k) == 4 else 1
        return 2.0 * numel(_val(args[0])) * keys
    if name == "sparse_flash_attention":
        return 4.0 * numel(_val(args[0])) * (_shape(args[3]) or [1])[-1]
    return float(sum(numel(v) for v in _outputs(node)))


def _outputs(node: torch.fx.Node) -> list[Any]:
    value = node.meta.get("val")
    return list(value) if isinstance(value, (tuple, list)) else [value]


def node_bytes(node: torch.fx.Node) -> float:
    """Bytes read and written; a written input counts only through the values written into it."""
    schema = getattr(node.target, "_schema", None)
    written = {i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write} \
        if schema else set()
    total = 0
    for i, arg in enumerate(node.args):
        if i in written:
            continue
        if i == 0 and node.target in _GATHERS:
            total += nbytes(node.meta.get("val"))
            continue
        total += nbytes(_val(arg)) if not isinstance(arg, (tuple, list)) else sum(nbytes(_val(a)) for a in arg)
    if not written:
        total += nbytes(node.meta.get("val"))
    return float(total)


def node_seconds(node: torch.fx.Node, profile: DeviceProfile) -> float:
    """Modeled run time of one node; 0 for nodes that launch nothing."""
    if is_free(node):
        return 0.0
    compute = node_flops(node) / profile.flops_per_s
    memory = node_bytes(node) / profile.bytes_per_s
    return profile.launch_s + max(compute, memory)

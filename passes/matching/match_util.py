"""What a failed or partial match says, and the small structures fusion passes read: masks in their usual
forms, the parts of a top-k, paged cache reads, and the near-miss record."""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from npu_graph.passes.matching.values import is_neg_inf, val

aten = torch.ops.aten


class NoMatch(Exception):
    """The candidate does not match; `near` marks a candidate worth reporting as a near miss."""

    def __init__(self, reason: str, near: bool = True):
        super().__init__(reason)
        self.near = near


@dataclass
class Mask:
    """How a score tensor was masked: `tensor` is bool visible/invisible or an additive float mask."""

    kind: str  # "visible" | "invisible" | "additive"
    tensor: torch.fx.Node


def peel_mask(node: torch.fx.Node) -> tuple[torch.fx.Node, Mask | None]:
    """Score node without its mask, and the mask (masked_fill / where / additive) if there is one."""
    target, args = node.target, node.args
    if target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor) and is_neg_inf(args[2]):
        return args[0], Mask("invisible", args[1])
    if target == aten.where.self and is_neg_inf(args[2]):
        return args[1], Mask("visible", args[0])
    if target == aten.where.self and is_neg_inf(args[1]):
        return args[2], Mask("invisible", args[0])
    if target == aten.add.Tensor and all(isinstance(a, torch.fx.Node) for a in args[:2]):
        a, b = val(args[0]), val(args[1])
        if a is not None and b is not None and b.dtype.is_floating_point and b.dim() >= 2:
            return args[0], Mask("additive", args[1])
    return node, None


def topk_parts(topk: torch.fx.Node) -> tuple[torch.fx.Node | None, torch.fx.Node | None]:
    """The getitem users of a topk node for its values (0) and indices (1)."""
    parts: dict[int, torch.fx.Node] = {}
    for user in topk.users:
        if user.target is operator.getitem:
            parts[user.args[1]] = user
    return parts.get(0), parts.get(1)


def paged_read(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(cache [NB, BS, 1, D], block_table [B, MB]) when `node` is `cache[block_table]`, a paged cache read."""
    if node.target != aten.index.Tensor or len(node.args[1]) != 1 or node.args[1][0] is None:
        return None
    cache, table = node.args[0], node.args[1][0]
    cv, tv = val(cache), val(table)
    if cv is None or tv is None or cv.dim() != 4 or tv.dim() != 2 or cv.shape[2] != 1:
        return None
    return cache, table


def near_miss(pattern: str, node: torch.fx.Node, reason: str) -> dict[str, str]:
    return {"pattern": pattern, "node": node.name, "reason": reason}

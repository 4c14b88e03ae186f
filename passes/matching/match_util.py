"""What a failed or partial match says, and the small structures fusion passes read: the parts of a top-k, paged
cache reads, and the near-miss record (masks: passes/canonical/masks.py)."""
from __future__ import annotations

import operator

import torch
import torch.fx

from npu_graph.passes.matching.values import val

aten = torch.ops.aten


class NoMatch(Exception):
    """The candidate does not match; `near` marks a candidate worth reporting as a near miss. `canonical` is the
    candidate's canonical expression at the anchor and `differs` the first of its terms that is not the pattern's
    (passes/canonical/printer.py), where the pass read that far."""

    def __init__(self, reason: str, near: bool = True, canonical: str | None = None, differs: str | None = None):
        super().__init__(reason)
        self.near = near
        self.canonical = canonical
        self.differs = differs


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


def near_miss(pattern: str, node: torch.fx.Node, reason: str, canonical: str | None = None,
              differs: str | None = None) -> dict[str, str]:
    record = {"pattern": pattern, "node": node.name, "reason": reason}
    if canonical:
        record["canonical"] = canonical
    if differs:
        record["differs"] = differs
    return record

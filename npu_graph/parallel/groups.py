"""CP×TP process groups on an initialized `torch.distributed` world of cp·tp ranks.

Global rank = cp_rank · tp + tp_rank: TP is the inner dimension (the ranks of one TP group are neighbours,
on one machine in practice) and splits attention heads; the ranks sharing a tp_rank form a CP group that
splits the sequence. Every rank creates every group, in the same order, as `torch.distributed.new_group`
requires. A `None` group stands for size one (no communication), so the CP and TP functions also run in a
plain single process.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the CP×TP grid and its two groups (None where the size is 1)."""

    cp: int
    tp: int
    cp_rank: int
    tp_rank: int
    cp_group: dist.ProcessGroup | None
    tp_group: dist.ProcessGroup | None


def group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(size, this rank's index) of `group`; (1, 0) for None."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def init_cp_tp(cp: int, tp: int) -> ParallelGroups:
    """Build the CP and TP groups of a world of exactly cp·tp ranks (call on every rank)."""
    if cp < 1 or tp < 1:
        raise ValueError(f"init_cp_tp: cp and tp must be >= 1, got cp={cp}, tp={tp}")
    if not dist.is_initialized():
        raise RuntimeError("init_cp_tp: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first, or run under npu_graph.parallel.launch")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != cp * tp:
        raise ValueError(f"init_cp_tp: the world has {world} ranks but cp·tp = {cp}·{tp} = {cp * tp}; "
                         f"choose cp and tp whose product is the world size")
    cp_rank, tp_rank = divmod(rank, tp)
    cp_group = tp_group = None
    for t in range(tp):
        group = dist.new_group([c * tp + t for c in range(cp)]) if cp > 1 else None
        if t == tp_rank:
            cp_group = group
    for c in range(cp):
        group = dist.new_group([c * tp + t for t in range(tp)]) if tp > 1 else None
        if c == cp_rank:
            tp_group = group
    return ParallelGroups(cp, tp, cp_rank, tp_rank, cp_group, tp_group)

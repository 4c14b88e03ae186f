"""DP×CP×TP process groups, and an expert-parallel (EP) group over any of those dimensions, on an initialized
`torch.distributed` world of dp·cp·tp ranks.

Global rank = (dp_rank · cp + cp_rank) · tp + tp_rank: TP is the inner dimension (the ranks of one TP group
are neighbours, on one machine in practice) and splits attention heads, so its ranks hold the same tokens; the
ranks sharing (dp_rank, tp_rank) form a CP group that splits the sequence; DP replicas run different batches.
The EP group is the product of the dimensions named in `ep_dims` (the ranks that differ only there): MoE layers
exchange tokens across it, and its ranks keep 1/EP of the routed experts each (`shard_experts(model, groups)`).
Every rank creates every group, in the same order, as `torch.distributed.new_group` requires. A `None` group
stands for size one (no communication), so the functions also run in a plain single process.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch.distributed as dist

DIMS = ("dp", "cp", "tp")


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the DP×CP×TP grid and its groups (None where the size is 1)."""

    cp: int
    tp: int
    cp_rank: int
    tp_rank: int
    cp_group: dist.ProcessGroup | None
    tp_group: dist.ProcessGroup | None
    dp: int = 1
    dp_rank: int = 0
    dp_group: dist.ProcessGroup | None = None
    ep_dims: tuple[str, ...] = ()
    ep_group: dist.ProcessGroup | None = None

    @property
    def ep(self) -> int:
        """The EP size: the product of the sizes of `ep_dims`."""
        return group_size_rank(self.ep_group)[0]


def group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(size, this rank's index) of `group`; (1, 0) for None."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _group_over(shape: dict[str, int], dims: tuple[str, ...], coord: dict[str, int]) -> dist.ProcessGroup | None:
    """Create the groups of ranks that differ only in `dims` (every rank makes all of them, in one order) and
    return this rank's; None when the product of those sizes is 1."""
    if all(shape[d] == 1 for d in dims):
        return None
    mine = None
    fixed = [d for d in DIMS if d not in dims]
    for others in itertools.product(*(range(shape[d]) for d in fixed)):
        base = dict(zip(fixed, others))
        ranks = [_rank(shape, {**base, **dict(zip(dims, inner))})
                 for inner in itertools.product(*(range(shape[d]) for d in dims))]
        group = dist.new_group(sorted(ranks))
        if all(base[d] == coord[d] for d in fixed):
            mine = group
    return mine


def _rank(shape: dict[str, int], coord: dict[str, int]) -> int:
    return (coord["dp"] * shape["cp"] + coord["cp"]) * shape["tp"] + coord["tp"]


def init_parallel(dp: int = 1, cp: int = 1, tp: int = 1, ep_dims: tuple[str, ...] = ()) -> ParallelGroups:
    """Build the DP, CP, TP groups of a world of exactly dp·cp·tp ranks and the EP group over `ep_dims` (a
    subset of ("dp", "cp", "tp"); empty: no EP group). Call on every rank."""
    shape = {"dp": dp, "cp": cp, "tp": tp}
    if min(shape.values()) < 1:
        raise ValueError(f"init_parallel: dp, cp and tp must be >= 1, got dp={dp}, cp={cp}, tp={tp}")
    unknown = [d for d in ep_dims if d not in DIMS]
    if unknown or len(set(ep_dims)) != len(ep_dims):
        raise ValueError(f"init_parallel: ep_dims={ep_dims!r} must name distinct dimensions among {DIMS}")
    if not dist.is_initialized():
        raise RuntimeError("init_parallel: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first, or run under npu_graph.parallel.launch")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != dp * cp * tp:
        raise ValueError(f"init_parallel: the world has {world} ranks but dp·cp·tp = {dp}·{cp}·{tp} = "
                         f"{dp * cp * tp}; choose sizes whose product is the world size")
    outer, tp_rank = divmod(rank, tp)
    dp_rank, cp_rank = divmod(outer, cp)
    coord = {"dp": dp_rank, "cp": cp_rank, "tp": tp_rank}
    groups = {d: _group_over(shape, (d,), coord) for d in ("cp", "tp", "dp")}
    ep_dims = tuple(d for d in DIMS if d in ep_dims)
    ep_group = groups[ep_dims[0]] if len(ep_dims) == 1 else _group_over(shape, ep_dims, coord) if ep_dims else None
    return ParallelGroups(cp, tp, cp_rank, tp_rank, groups["cp"], groups["tp"], dp, dp_rank, groups["dp"],
                          ep_dims, ep_group)


def init_cp_tp(cp: int, tp: int) -> ParallelGroups:
    """Build the CP and TP groups of a world of exactly cp·tp ranks (call on every rank)."""
    if cp < 1 or tp < 1:
        raise ValueError(f"init_cp_tp: cp and tp must be >= 1, got cp={cp}, tp={tp}")
    if dist.is_initialized() and dist.get_world_size() != cp * tp:
        raise ValueError(f"init_cp_tp: the world has {dist.get_world_size()} ranks but cp·tp = {cp}·{tp} = "
                         f"{cp * tp}; choose cp and tp whose product is the world size")
    return init_parallel(cp=cp, tp=tp)

"""Expert placement for expert parallelism: which experts each EP rank holds, from observed expert loads.

A placement is one list of expert ids per rank, E/W each (dispatch, like MC2, gives every rank the same number
of local experts); experts are "logical" ids as the router emits them. The default, contiguous blocks, puts
experts [r·E/W, (r+1)·E/W) on rank r: a router that favours a few neighbouring experts loads one rank well
above the others. `balanced_placement` packs experts by observed load instead, as DeepSeek's EPLB does without
replicas: heaviest first, each to the least-loaded rank that has a free slot. Under a placement, the EP layer
maps each logical id to its physical slot (rank r's j-th expert is slot r·E/W + j) before dispatch, so the
dispatch/combine ops and their MC2 lowering are unchanged. `record_expert_loads` counts, per MoE block, the
rows the router sends to each expert while a model runs calibration inputs.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from npu_graph.models.moe import DeepSeekMoE

Placement = Sequence[Sequence[int]]


def contiguous_placement(num_experts: int, world: int) -> list[list[int]]:
    """Rank r holds experts [r·E/W, (r+1)·E/W)."""
    local = num_experts // world
    return [list(range(rank * local, (rank + 1) * local)) for rank in range(world)]


def balanced_placement(loads: torch.Tensor, world: int) -> list[list[int]]:
    """E/W experts per rank, packed by load (heaviest first onto the least-loaded rank with a free slot; ties to
    the lower rank), each rank's experts in ascending id order."""
    experts = loads.numel()
    if experts % world:
        raise ValueError(f"balanced_placement: {experts} experts do not split evenly over {world} ranks")
    local = experts // world
    order = sorted(range(experts), key=lambda e: (-float(loads[e]), e))
    ranks: list[list[int]] = [[] for _ in range(world)]
    totals = [0.0] * world
    for expert in order:
        rank = min((r for r in range(world) if len(ranks[r]) < local), key=lambda r: (totals[r], r))
        ranks[rank].append(expert)
        totals[rank] += float(loads[expert])
    return [sorted(held) for held in ranks]


def rank_loads(loads: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Rows each rank receives under `placement`, from per-expert loads."""
    return torch.stack([loads[list(held)].sum() for held in placement])


def check_placement(placement: Placement, num_experts: int, world: int, where: str) -> list[list[int]]:
    """`placement` as lists, after checking it gives each of `world` ranks E/W distinct experts, every expert
    exactly once."""
    held = [list(map(int, experts)) for experts in placement]
    flat = sorted(e for experts in held for e in experts)
    if len(held) != world or flat != list(range(num_experts)) or len({len(h) for h in held}) != 1:
        raise ValueError(f"shard_experts: the placement for {where} must list, for each of the {world} EP ranks, "
                         f"{num_experts // world} experts, every one of the {num_experts} exactly once; got "
                         f"{held}")
    return held


def physical_slots(placement: Placement) -> torch.Tensor:
    """slot[e]: the physical slot of logical expert e (rank r's j-th expert is slot r·L + j)."""
    order = [e for experts in placement for e in experts]
    slots = torch.empty(len(order), dtype=torch.long)
    slots[torch.tensor(order)] = torch.arange(len(order))
    return slots


def is_stacked_experts(module: nn.Module) -> bool:
    """transformers' stacked experts: `gate_up_proj` [E,2I,H] and `down_proj` [E,H,I] tensors."""
    up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor) and up.dim() == 3 and down.dim() == 3


def _counter(loads: dict[str, torch.Tensor], name: str, experts: int) -> Callable[[torch.Tensor], None]:
    def add(ids: torch.Tensor) -> None:
        counts = torch.bincount(ids.detach().reshape(-1).long().cpu(), minlength=experts)
        loads[name] = loads.get(name, torch.zeros(experts, dtype=torch.long)) + counts
    return add


@contextlib.contextmanager
def record_expert_loads(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Within the block, count per MoE block (named as shard_experts names it) the rows routed to each expert:
    `with record_expert_loads(model) as loads: model(calibration)`; then `balanced_placement(loads[name], W)`."""
    loads: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, DeepSeekMoE):
            add = _counter(loads, name, len(module.experts))
            handles.append(module.gate.register_forward_hook(lambda _m, _a, out, add=add: add(out[1])))
        elif is_stacked_experts(module):
            add = _counter(loads, name, module.gate_up_proj.shape[0])
            handles.append(module.register_forward_pre_hook(lambda _m, args, add=add: add(args[1])))
    try:
        yield loads
    finally:
        for handle in handles:
            handle.remove()

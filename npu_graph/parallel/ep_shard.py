"""`shard_experts(model, ep_group)`: keep only this rank's routed experts in every MoE block of a model.

Recognised blocks: the reference model's `DeepSeekMoE` (npu_graph.models.moe), replaced by `EPDeepSeekMoE`,
and transformers' stacked SwiGLU experts (`gate_up_proj` [E,2I,H], `down_proj` [E,H,I], SiLU; the `experts`
of Qwen3-MoE, DeepSeek-V3.2 and Kimi Linear MoE blocks), replaced by `EPExperts`. Routers and shared experts
stay as they are (replicated). Rank r of an EP group of W keeps experts [r·E/W, (r+1)·E/W), or those a placement
gives it (ep_placement.py: packed by observed load, for skewed routing).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from npu_graph.models.moe import DeepSeekMoE
from npu_graph.parallel.ep_layer import EPDeepSeekMoE, EPExperts
from npu_graph.parallel.ep_placement import Placement, check_placement, contiguous_placement, is_stacked_experts
from npu_graph.parallel.groups import ParallelGroups


@dataclass(frozen=True)
class EPLayer:
    """One MoE block made expert-parallel: where it is and which experts this rank kept."""
    name: str
    num_experts: int
    local_experts: Sequence[int]
    ep_world_size: int


def _as_group(ep_group: object) -> dist.ProcessGroup:
    """A ProcessGroup from a ProcessGroup, a DeviceMesh (several dimensions: their flattened product) or the
    `ep_group` of ParallelGroups."""
    if not dist.is_initialized():
        raise RuntimeError("shard_experts: torch.distributed is not initialized; call init_process_group first "
                           "(or run under npu_graph.parallel.launch)")
    if isinstance(ep_group, ParallelGroups):
        if ep_group.ep_group is None:
            raise ValueError(f"shard_experts: these ParallelGroups have no EP group (ep_dims={ep_group.ep_dims}, "
                             f"size 1); pass init_parallel(..., ep_dims=...) naming dimensions of size > 1")
        ep_group = ep_group.ep_group
    if hasattr(ep_group, "get_group") and hasattr(ep_group, "ndim"):
        ep_group = (ep_group if ep_group.ndim == 1 else ep_group._flatten()).get_group()
    if ep_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"shard_experts: this process (global rank {dist.get_rank()}) is not a member of the "
                         f"EP group (new_group gave it NON_GROUP_MEMBER); call shard_experts with a group that "
                         f"contains it")
    if not isinstance(ep_group, dist.ProcessGroup):
        raise TypeError(f"shard_experts: ep_group must be a torch.distributed ProcessGroup, a DeviceMesh or "
                        f"ParallelGroups, got {type(ep_group).__name__}")
    return ep_group


def _check_stacked(name: str, module: nn.Module) -> None:
    experts, inter2, hidden = module.gate_up_proj.shape
    if tuple(module.down_proj.shape) != (experts, hidden, inter2 // 2) or inter2 % 2:
        raise ValueError(f"shard_experts: {name} has gate_up_proj {tuple(module.gate_up_proj.shape)} and "
                         f"down_proj {tuple(module.down_proj.shape)}; only [E,2I,H] and [E,H,I] are supported")
    act = getattr(module, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    if getattr(module, "has_bias", False) or not silu:
        raise ValueError(f"shard_experts: {name} is not a bias-free SiLU (SwiGLU) experts module; expert "
                         f"parallelism supports only those")


def _placement(full: int, group: dist.ProcessGroup, name: str, placement: object) -> list[list[int]]:
    """Every rank's experts for block `name`: `placement` (one for all blocks, or a mapping by block name), else
    contiguous blocks."""
    world = dist.get_world_size(group)
    if full % world:
        raise ValueError(f"shard_experts: {name} has {full} routed experts, which do not split evenly over "
                         f"an EP group of {world} ranks; use an EP size that divides {full}")
    if isinstance(placement, Mapping):
        placement = placement.get(name)
    if placement is None:
        return contiguous_placement(full, world)
    return check_placement(placement, full, world, name)


def _shard_stacked(name: str, module: nn.Module, group: dist.ProcessGroup, placement: object,
                   **options: Any) -> EPExperts:
    _check_stacked(name, module)
    full = module.gate_up_proj.shape[0]
    ranks = _placement(full, group, name, placement)
    held = torch.tensor(ranks[dist.get_rank(group)])
    return EPExperts(module.gate_up_proj.detach()[held].clone(), module.down_proj.detach()[held].clone(), full,
                     group, placement=ranks, **options)


def _shard_reference(name: str, block: DeepSeekMoE, group: dist.ProcessGroup, placement: object,
                     **options: Any) -> EPDeepSeekMoE:
    ranks = _placement(len(block.experts), group, name, placement)
    kept = [block.experts[e] for e in ranks[dist.get_rank(group)]]
    w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in kept]).detach()
    w2 = torch.stack([e.down_proj.weight for e in kept]).detach()
    return EPDeepSeekMoE(block, EPExperts(w13, w2, len(block.experts), group, placement=ranks, **options))


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def _check_agreement(group: dist.ProcessGroup, layers: list[EPLayer]) -> None:
    """Every rank of the group must shard the same blocks with the same expert counts."""
    mine = [(layer.name, layer.num_experts) for layer in layers]
    every: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    for rank, theirs in enumerate(every):
        if theirs != mine:
            raise ValueError(f"shard_experts: EP rank {rank} shards MoE blocks {theirs} but this rank "
                             f"({dist.get_rank(group)}) shards {mine}: every rank of the EP group must pass the "
                             f"same model and the same group")


def shard_experts(model: nn.Module, ep_group: object, *, quant_mode: int = 0,
                  tp_group: dist.ProcessGroup | None = None,
                  placement: Placement | Mapping[str, Placement] | None = None) -> list[EPLayer]:
    """Replace every MoE block's routed experts by this rank's share (in place; call on every rank of the EP
    group). `ep_group`: a ProcessGroup, a DeviceMesh (a 1-D mesh, or several dimensions taken together) or
    ParallelGroups from `init_parallel` (its EP group; its TP group becomes `tp_group`). `tp_group`: ranks that
    hold the same tokens split them before dispatch and all-gather the outputs. quant_mode=2 sends dispatched rows
    as int8 with per-row scales. `placement`: each rank's experts (ep_placement.balanced_placement from observed
    loads), for every block or by block name; default contiguous blocks. Returns the blocks made expert-parallel;
    raises ValueError when there are none."""
    if isinstance(ep_group, ParallelGroups) and tp_group is None:
        tp_group = ep_group.tp_group
    group = _as_group(ep_group)
    if quant_mode not in (0, 2):
        raise ValueError(f"shard_experts: quant_mode={quant_mode} is not supported; use 0 (none) or 2 (dynamic "
                         f"per-token int8)")
    options = {"quant_mode": quant_mode, "tp_group": tp_group, "placement": placement}
    layers = []
    for name, module in list(model.named_modules()):
        if isinstance(module, (EPExperts, EPDeepSeekMoE)):
            raise ValueError(f"shard_experts: {name} is already expert-parallel; shard a fresh model")
        if isinstance(module, DeepSeekMoE):
            new = _shard_reference(name, module, group, **options)
            ep = new.experts
        elif is_stacked_experts(module):
            new = ep = _shard_stacked(name, module, group, **options)
        else:
            continue
        _replace(model, name, new)
        layers.append(EPLayer(name, ep.num_experts, ep.local_experts, ep.ep_world_size))
    if not layers:
        raise ValueError(f"shard_experts: {type(model).__name__} has no MoE block this function knows "
                         f"(npu_graph DeepSeekMoE, or transformers' stacked SwiGLU experts)")
    _check_agreement(group, layers)
    return layers

"""Per-rank programs for the expert-parallel tests (importable by name in spawned ranks).

Inputs come from fixed seeds: a rank builds the same expert weights as the single-process reference and its
own tokens from its rank in the EP group, so each rank checks its own output against `fused_moe` over all
experts, and the parent test only compares numbers.
"""
from __future__ import annotations

import time

import ep_mesh_workers
import torch
import torch.distributed as dist
from torch import nn

from npu_graph.parallel import shard_experts
from npu_graph.parallel.ep_quant import dequantize_rows

EXPERTS, HIDDEN, INTER, TOP_K = 8, 32, 16, 2
ops = torch.ops.ascend_dsa


def expert_weights(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return ((torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / 4).to(dtype),
            (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / 4).to(dtype))


def routed_inputs(rank: int, tokens: int, world: int, skew_to: int | None = None,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [tokens, H], distinct expert ids [tokens, k] (all on rank `skew_to`'s experts when given), weights."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    if skew_to is None:
        ids = torch.rand(tokens, EXPERTS, generator=g).argsort(dim=-1)[:, :TOP_K]
    else:
        local = EXPERTS // world
        ids = skew_to * local + torch.rand(tokens, local, generator=g).argsort(dim=-1)[:, :TOP_K]
    return x, ids, torch.rand(tokens, TOP_K, generator=g)


def ep_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, group: dist.ProcessGroup,
           quant_mode: int = 0, global_bs: int = 0) -> tuple[torch.Tensor, tuple]:
    """dispatch -> this rank's experts -> combine; also returns dispatch's outputs."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local = EXPERTS // world
    w13, w2 = expert_weights(x.dtype)
    sent = ops.moe_dispatch(x, ids, group.group_name, world, rank, EXPERTS, quant_mode=quant_mode,
                            global_bs=global_bs)
    rows = dequantize_rows(sent[0], sent[1], x.dtype) if quant_mode == 2 else sent[0]
    y = ops.grouped_swiglu(rows, w13[rank * local:(rank + 1) * local], w2[rank * local:(rank + 1) * local],
                           sent[3])
    return ops.moe_combine(y, ids, sent[2], sent[4], weights, group.group_name, world, rank, EXPERTS), sent


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _case(group: dist.ProcessGroup, tokens: int, skew_to: int | None = None, quant_mode: int = 0,
          dtype: torch.dtype = torch.float32, global_bs: int = 0) -> dict:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    x, ids, weights = routed_inputs(rank, tokens, world, skew_to, dtype)
    out, sent = ep_moe(x, ids, weights, group, quant_mode, global_bs)
    want = ops.fused_moe(x, *expert_weights(dtype), weights.to(dtype), ids)
    exact, _ = ep_moe(x, ids, weights, group) if quant_mode else (out, None)
    cosine = torch.nn.functional.cosine_similarity(out.float().flatten(), exact.float().flatten(), dim=0)
    return {"rel": _relative(out, want), "cosine": cosine.item(), "rows": sent[0].shape[0],
            "received": int(sent[3].sum()), "token_nums": sent[3].tolist(), "dtype": out.dtype,
            "tail_zero": bool((sent[0][int(sent[3].sum()):] == 0).all())}


def _subgroups(size: int) -> dist.ProcessGroup:
    """Split the world into EP groups of `size` consecutive ranks (every rank creates every group)."""
    world, mine = dist.get_world_size(), None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= dist.get_rank() < start + size:
            mine = group
    return mine


def dispatch_checks(sizes: list[int]) -> dict:
    """Every dispatch/combine case for EP groups of each size in `sizes`, keyed by (size, case)."""
    results = {}
    for size in sizes:
        group = dist.group.WORLD if size == dist.get_world_size() else _subgroups(size)
        rank = dist.get_rank(group)
        results[size, "uniform"] = _case(group, 12)
        results[size, "decode"] = _case(group, 1)
        results[size, "skew_first"] = _case(group, 12, skew_to=0)
        results[size, "skew_last"] = _case(group, 12, skew_to=size - 1)
        results[size, "quant"] = _case(group, 12, quant_mode=2)
        results[size, "quant_skew"] = _case(group, 12, skew_to=0, quant_mode=2)
        results[size, "bf16"] = _case(group, 12, dtype=torch.bfloat16)
        uneven = [3 + 4 * r for r in range(size)]
        results[size, "uneven"] = _case(group, uneven[rank], skew_to=0, global_bs=size * max(uneven))
    return results


class ToyExperts(nn.Module):
    """Stacked SwiGLU experts shaped like transformers' (gate_up_proj [E,2I,H], down_proj [E,H,I])."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * INTER, HIDDEN))
        self.down_proj = nn.Parameter(torch.randn(experts, HIDDEN, INTER))
        self.act_fn = nn.SiLU()


class ToyMoE(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.experts = ToyExperts(experts)


def _error(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def error_checks() -> dict:
    """Messages of the bad calls (every rank of a collective fails alike, so none is left waiting)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    first_two = dist.new_group([0, 1])
    x, ids, _ = routed_inputs(rank, 4, world)
    name = dist.group.WORLD.group_name
    errors = {
        "indivisible": _error(shard_experts, ToyMoE(6), dist.group.WORLD),
        "mismatched_models": _error(shard_experts, ToyMoE(8 if rank == 0 else 16), dist.group.WORLD),
        "wrong_ep_size": _error(ops.moe_dispatch, x, ids, name, world // 2, rank, EXPERTS),
        "wrong_ep_rank": _error(ops.moe_dispatch, x, ids, name, world, (rank + 1) % world, EXPERTS),
        "ids_out_of_range": _error(ops.moe_dispatch, x, ids + EXPERTS, name, world, rank, EXPERTS),
        "not_a_group": _error(shard_experts, ToyMoE(8), "world"),
        "no_moe": _error(shard_experts, nn.Linear(2, 2), dist.group.WORLD),
    }
    errors.update(_peer_errors(x, ids, name))
    if rank >= 2:
        errors["not_a_member"] = _error(shard_experts, ToyMoE(8), first_two)
    model = ToyMoE(8)
    shard_experts(model, dist.group.WORLD)
    errors["twice"] = _error(shard_experts, model, dist.group.WORLD)
    return errors


def _peer_errors(x: torch.Tensor, ids: torch.Tensor, name: str) -> dict:
    """Input that only some ranks get wrong, or that only the group as a whole can see is wrong: every rank
    must fail from the first collective, at once (the seconds each took are kept)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    repeated = ids.clone()
    repeated[1, 1] = repeated[1, 0]
    more, more_ids, _ = routed_inputs(rank, 4 + rank, world)
    cases = {
        "one_rank_bad_ids": (x, ids + EXPERTS * (rank == 1), 0),
        "repeated_ids": (x, repeated if rank == 0 else ids, 0),
        "uneven_without_global_bs": (more, more_ids, 0),
        "global_bs_too_small": (x, ids, world * x.shape[0] - 1),
    }
    errors = {}
    for case, (xs, ids_, global_bs) in cases.items():
        start = time.perf_counter()
        errors[case] = _error(ops.moe_dispatch, xs, ids_, name, world, rank, EXPERTS, global_bs=global_bs)
        errors[case + "_s"] = time.perf_counter() - start
    return errors


def die_in_dispatch() -> None:
    """Rank 1 dies while rank 0 waits in dispatch."""
    import os
    if dist.get_rank() == 1:
        os._exit(3)
    x, ids, weights = routed_inputs(0, 4, dist.get_world_size())
    ep_moe(x, ids, weights, dist.group.WORLD)


def op_checks(sizes: list[int]) -> dict:
    """dispatch_checks(sizes), error_checks() and, on 4 ranks, EP composed with CP×TP meshes, in one run."""
    mesh = ep_mesh_workers.mesh_checks(ep_mesh_workers.LAYOUTS_4) if dist.get_world_size() == 4 else {}
    return {"dispatch": dispatch_checks(sizes), "errors": error_checks(), "mesh": mesh}

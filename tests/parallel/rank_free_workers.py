"""Per-rank program for the rank-free graph tests (importable by name in spawned ranks): an expert-parallel MoE
step whose group and rank Dynamo writes into the graph, and an all-gather, compiled by every rank through one
cache folder."""
from __future__ import annotations

import ep_workers
import torch
import torch.distributed as dist
from torch import nn

from npu_graph.backend import Backend
from npu_graph.config import CompilerConfig
from npu_graph.parallel import rank_free


class Step(nn.Module):
    """dispatch -> this rank's experts -> combine over `ep`, then an all-gather over `gather` (both from Dynamo's
    view: a group name and this rank's position in it, as constants)."""

    def __init__(self, ep: dist.ProcessGroup, gather: dist.ProcessGroup):
        super().__init__()
        self.ep, self.gather = ep, gather
        self.world, self.rank = dist.get_world_size(ep), dist.get_rank(ep)
        local = ep_workers.EXPERTS // self.world
        w13, w2 = ep_workers.expert_weights()
        self.register_buffer("w13", w13[self.rank * local:(self.rank + 1) * local])
        self.register_buffer("w2", w2[self.rank * local:(self.rank + 1) * local])

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ops, name, experts = torch.ops.ascend_dsa, self.ep.group_name, ep_workers.EXPERTS
        rows, _, sent, counts, recv = ops.moe_dispatch(x, ids, name, self.world, self.rank, experts)
        y = ops.grouped_swiglu(rows, self.w13, self.w2, counts)
        out = ops.moe_combine(y, ids, sent, recv, weights, name, self.world, self.rank, experts)
        gathered = out.new_empty(out.shape[0] * dist.get_world_size(self.gather), out.shape[1])
        dist.all_gather_single(gathered, out.contiguous(), group=self.gather)
        return gathered


def compile_together(cache_dir: str) -> dict:
    """Every rank compiles Step through `cache_dir` at once (the entry's lease makes one of them compile it); its
    output against eager, its cache decision, and the aliases this process gave WORLD and a second group of the
    same ranks."""
    world = dist.group.WORLD
    copy = dist.new_group(list(range(dist.get_world_size())))
    step = Step(world, copy)
    x, ids, weights = ep_workers.routed_inputs(dist.get_rank(), 6, dist.get_world_size())
    backend = Backend(CompilerConfig.from_options({"cache_dir": cache_dir, "strict": True}))
    with torch.no_grad():
        want = step(x, ids, weights)
        got = torch.compile(step, backend=backend, fullgraph=True)(x, ids, weights)
    (report,) = backend.reports
    return {"aliases": [rank_free.alias(world), rank_free.alias(copy)], "cache": report.cache,
            "fallback": report.fallback, "rel": float((got - want).abs().max() / want.abs().max()),
            "ep": report.extra.get("expert_parallel")}

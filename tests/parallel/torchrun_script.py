"""A user's script, as tests/parallel/test_torchrun.py starts it under `torchrun` (one host, or several
simulated nodes): `torchrun ... torchrun_script.py OUT_DIR WORKLOAD[,WORKLOAD...]`. Each rank joins the gloo
group torchrun describes, runs each workload and saves its results (and its graphs' cache decisions) to
OUT_DIR/rank<R>.pt:

- dsa: the reference model's DSA layers' prefill under CP×TP (cp = 2, tp = world / 2), restored to sequence order;
- ep: the reference model with its experts sharded over the world, compiled with ascend_dsa, on tokens of its own;
- mesh: the reference model compiled under CP×TP with its experts sharded over CP×TP (init_parallel), each CP
  rank on tokens of its own (the TP ranks of a CP rank share them).
"""
from __future__ import annotations

import os
import sys

import cp_workers
import torch
import torch.distributed as dist

import npu_graph
from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.parallel import cp_dsa_prefill, gather_zigzag, init_cp_tp, init_parallel, shard_experts, zigzag_split


def tokens(index: int) -> torch.Tensor:
    """The prompt of rank (or CP rank) `index`; the test builds the same one."""
    return torch.randint(3, 250, (1, 24), generator=torch.Generator().manual_seed(100 + index))


def reference() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(HybridConfig.named("tiny")).eval()


def dsa() -> list[torch.Tensor]:
    groups = init_cp_tp(2, dist.get_world_size() // 2)
    model, x = cp_workers.reference_model()
    local = zigzag_split(x, groups.cp, groups.cp_rank, dim=1)
    with torch.no_grad():
        return [gather_zigzag(cp_dsa_prefill(model.layers[i].mixer, local, groups), groups.cp_group, 1)
                for i in cp_workers.DSA_LAYERS]


def _compiled_logits(model: HybridLM, ids: torch.Tensor) -> torch.Tensor:
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(model, backend="ascend_dsa")(ids)


def ep() -> torch.Tensor:
    model = reference()
    shard_experts(model, dist.group.WORLD)
    return _compiled_logits(model, tokens(dist.get_rank()))


def mesh() -> torch.Tensor:
    groups = init_parallel(1, 2, dist.get_world_size() // 2, ("cp", "tp"))
    model = reference()
    shard_experts(model, groups)
    return _compiled_logits(model, tokens(groups.cp_rank))


WORKLOADS = {"dsa": dsa, "ep": ep, "mesh": mesh}

if __name__ == "__main__":
    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    dist.init_process_group("gloo")
    results = {"rank": dist.get_rank(), **{name: WORKLOADS[name]() for name in names},
               "cache": [report.cache for report in npu_graph.get_backend({}).reports]}
    torch.save(results, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()

"""Per-rank programs for EP composed with DP×CP×TP (importable by name in spawned ranks).

Each rank holds the tokens its place in the mesh gives it: DP replicas and CP ranks different ones (seeded by
(dp_rank, cp_rank)), the ranks of a TP group the same. The reference model's MoE block sharded over the EP group
(`shard_experts(model, init_parallel(...))`) must equal the whole block on those tokens, and each TP rank must
send only its share of them through dispatch.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.models.moe import DeepSeekMoE
from npu_graph.parallel import init_parallel, shard_experts
from npu_graph.parallel.ep_layer import EPExperts

TOKENS = 9      # odd: a TP pair splits it 5 + 4, the second part padded


def _blocks() -> tuple[DeepSeekMoE, nn.Module]:
    """The whole MoE block and a parent holding an identical copy to shard."""
    torch.manual_seed(0)
    whole = next(m for m in HybridLM(HybridConfig.named("tiny")).modules() if isinstance(m, DeepSeekMoE)).eval()
    parent = nn.Module()
    parent.mlp = copy.deepcopy(whole)
    return whole, parent


def _count_rows(parent: nn.Module) -> list[int]:
    """Wrap the sharded block's dispatch path to record how many token rows each call sends."""
    experts = next(m for m in parent.modules() if isinstance(m, EPExperts))
    sent: list[int] = []
    inner = experts._expert_parallel

    def counted(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        sent.append(x.shape[0])
        return inner(x, *rest)

    experts._expert_parallel = counted
    return sent


def _run(parent: nn.Module, whole: DeepSeekMoE, seed: int, compiled: bool) -> dict:
    x = torch.randn(TOKENS, HybridConfig.named("tiny").hidden_size, generator=torch.Generator().manual_seed(seed))
    sent = [] if compiled else _count_rows(parent)
    torch._dynamo.reset()
    run = torch.compile(parent.mlp, backend="ascend_dsa", options={"cache": False}) if compiled else parent.mlp
    with torch.no_grad():
        got, want = run(x), whole(x)
    experts = next(m for m in parent.modules() if isinstance(m, EPExperts))
    return {"rel": ((got - want).abs().max() / want.abs().max()).item(), "sent": sent,
            "ep": experts.ep_world_size, "local": list(experts.local_experts), "tp_split": experts.tp_size}


def mesh_case(dp: int, cp: int, tp: int, ep_dims: tuple[str, ...], compiled: bool = False) -> dict:
    """One layout: groups from init_parallel, the block sharded over its EP group, checked against the whole."""
    groups = init_parallel(dp, cp, tp, ep_dims)
    whole, parent = _blocks()
    shard_experts(parent, groups)
    result = _run(parent, whole, 1000 + groups.dp_rank * cp + groups.cp_rank, compiled)
    return {**result, "coord": (groups.dp_rank, groups.cp_rank, groups.tp_rank), "ep_size": groups.ep}


def device_mesh_case(cp: int, tp: int) -> dict:
    """A (cp, tp) DeviceMesh passed whole: its flattened product is the EP group (TP split passed explicitly)."""
    mesh = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))
    whole, parent = _blocks()
    shard_experts(parent, mesh, tp_group=mesh["tp"].get_group())
    return _run(parent, whole, 1000 + mesh.get_local_rank("cp"), False)


LAYOUTS_4 = [(1, 2, 2, ("cp",)), (1, 2, 2, ("cp", "tp")), (1, 2, 2, ("tp",)), (2, 2, 1, ("dp", "cp"))]
LAYOUTS_8 = [(2, 2, 2, ("dp", "cp", "tp")), (2, 2, 2, ("dp", "cp"))]


def mesh_checks(layouts: list[tuple], compiled: bool = False) -> dict:
    """Every layout in `layouts` (eager; also compiled with ascend_dsa when asked), for a world of 4 the (2, 2)
    DeviceMesh, and the error for a dimension that does not exist."""
    results = {layout: mesh_case(*layout) for layout in layouts}
    if compiled:
        results.update({("compiled", layout): mesh_case(*layout, compiled=True) for layout in layouts})
    if dist.get_world_size() == 4:
        results["device_mesh"] = device_mesh_case(2, 2)
    try:
        init_parallel(1, 2, 2, ("ep",))
    except ValueError as error:
        results["bad_dims"] = str(error)
    return results


def check_layout(ranks: list[dict], layout: tuple, key: object = None) -> None:
    """Assert, over every rank's results, that `layout` (under `key`, default the layout) matched the whole
    block, sent ceil(T/tp) rows per TP rank, and that each EP group holds every expert exactly once."""
    dp, cp, tp, dims = layout
    sizes = {"dp": dp, "cp": cp, "tp": tp}
    ep = math.prod(sizes[d] for d in dims)
    experts: dict[tuple, list[int]] = {}
    for rank in ranks:
        result = rank[key if key is not None else layout]
        assert result["rel"] < 1e-5, (layout, result)
        assert result["ep"] == result["ep_size"] == ep and result["tp_split"] == tp
        assert result["sent"] in ([], [-(-TOKENS // tp)])
        fixed = tuple(c for c, d in zip(result["coord"], ("dp", "cp", "tp")) if d not in dims)
        experts.setdefault(fixed, []).extend(result["local"])
    assert all(sorted(held) == list(range(8)) for held in experts.values()), experts

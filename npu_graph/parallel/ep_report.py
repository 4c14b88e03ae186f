"""summary.json's `expert_parallel`: the MoE layers of a compiled graph that run expert-parallel.

One entry per `ascend_dsa::moe_dispatch` call, in graph order: the module it came from (when the capture kept
it), the EP group's name, its size and this rank's place in it, the experts held here out of how many, the dispatch
quantization and the static row bound of the dispatched rows. `local_experts` is the range of dispatch's expert
slots held here: the router's expert ids under the default contiguous placement; under a placement from
observed loads (ep_placement.py) those slots hold the experts the placement lists for this rank.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx

from npu_graph.parallel.rank_free import rank_in

_ARGS = ("x", "expert_ids", "group_ep", "ep_world_size", "ep_rank_id", "moe_expert_num")


def _module_path(node: torch.fx.Node) -> str | None:
    """The innermost module the node was traced in, without Dynamo's `L['self'].` root."""
    stack = node.meta.get("nn_module_stack")
    return next(reversed(stack.values()))[0].removeprefix("L['self'].") if stack else None


def _rows(node: torch.fx.Node) -> int | str | None:
    """The dispatched row bound: an int, or the symbolic expression when the token count is dynamic."""
    value = node.meta.get("val")
    if value is None:
        return None
    rows = value[0].shape[0]
    return int(rows) if isinstance(rows, int) else str(rows)


def expert_parallel_summary(gm: torch.fx.GraphModule) -> list[dict[str, Any]]:
    """The EP layers of `gm` (empty when it has none)."""
    layers = []
    for node in gm.graph.nodes:
        if node.target is not torch.ops.ascend_dsa.moe_dispatch.default:
            continue
        args = dict(zip(_ARGS, node.args))
        world, experts = args["ep_world_size"], args["moe_expert_num"]
        rank = rank_in(args["group_ep"], args["ep_rank_id"])
        local = experts // world
        layers.append({"module": _module_path(node), "group": args["group_ep"], "ep_world_size": world,
                       "ep_rank": rank, "experts": experts, "local_experts": [rank * local, (rank + 1) * local],
                       "quant_mode": node.kwargs.get("quant_mode", 0), "dispatch_rows": _rows(node)})
    return layers


def for_this_rank(layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`layers` of a summary another rank wrote (a cache entry compiled once for every rank: rank_free), with this
    process's rank and experts."""
    mine = []
    for layer in layers:
        rank = rank_in(layer["group"], -1) if layer.get("group") else layer["ep_rank"]
        local = layer["experts"] // layer["ep_world_size"]
        mine.append({**layer, "ep_rank": rank, "local_experts": [rank * local, (rank + 1) * local]})
    return mine

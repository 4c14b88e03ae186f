"""`ascend-dsa bench ep`: what MoE expert parallelism sends, how evenly it loads the ranks, what it stores
and what one MoE layer costs at EP=2 against one process.

- bytes: bytes on the wire per dispatched row and per token (k rows; combine returns each row in the
  activation dtype) for bf16 and int8 dispatch (quant_mode=2: H int8 values + one fp32 scale), at the
  reference model's and DeepSeek-V3's hidden sizes.
- load: rows each rank receives for DeepSeek-V3's routing shape (256 experts, top-8, 4096 tokens), max/mean
  over ranks (1.0 = even): uniform random routing, and skewed routing where expert popularity follows a Zipf
  law (s=1.2), as a router that favours a few experts does; for contiguous expert blocks and for experts placed
  by the loads observed on another batch (ep_placement.balanced_placement).
- memory and time: two gloo ranks shard the reference model (`shard_experts`) and report their parameter
  bytes, routed-expert bytes and the replicated rest; then one MoE layer of the "small" reference config
  (8 experts, top-2, hidden 512, T tokens) runs both ways side by side in each rank, one thread per rank:
  the whole layer (router, every expert through fused_moe, shared expert) and its EP=2 form (router,
  dispatch, this rank's 4 experts, combine, shared expert).
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.models.moe import DeepSeekMoE
from npu_graph.observe import progress
from npu_graph.parallel import launch, shard_experts
from npu_graph.parallel.ep_layer import EPExperts
from npu_graph.parallel.ep_placement import balanced_placement, contiguous_placement, rank_loads
from npu_graph.parallel.ep_quant import SCALE_BYTES
from npu_graph.tools.timing import time_side_by_side

HIDDEN_SIZES = {"reference tiny": (64, 2), "reference small": (512, 2), "DeepSeek-V3": (7168, 8)}
EP_SIZES = (2, 4, 8)
BF16_BYTES = 2


def bytes_rows() -> list[dict[str, Any]]:
    rows = []
    for name, (hidden, top_k) in HIDDEN_SIZES.items():
        bf16, int8 = hidden * BF16_BYTES, hidden + SCALE_BYTES
        combine = hidden * BF16_BYTES
        rows.append({"case": f"bytes {name} H={hidden} k={top_k}", "dispatch_row_bf16": bf16,
                     "dispatch_row_int8": int8, "dispatch_ratio": int8 / bf16,
                     "token_bf16": top_k * (bf16 + combine), "token_int8_dispatch": top_k * (int8 + combine)})
    return rows


def _routing(tokens: int, experts: int, top_k: int, zipf: float | None, sample_seed: int | None = None
             ) -> torch.Tensor:
    """Expert ids [tokens, top_k], distinct per token: uniform, or by Zipf popularity over shuffled experts (the
    same shuffle for every sample); `sample_seed` draws another batch from the same router preference."""
    g = torch.Generator().manual_seed(0)
    if zipf is None:
        popularity = torch.ones(experts)
    else:
        popularity = (1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** zipf)[torch.randperm(experts,
                                                                                                     generator=g)]
    if sample_seed is not None:
        g = torch.Generator().manual_seed(sample_seed)
    return torch.multinomial(popularity.float().expand(tokens, -1), top_k, replacement=False, generator=g)


def load_rows(tokens: int = 4096, experts: int = 256, top_k: int = 8) -> list[dict[str, Any]]:
    """Per-rank rows max/mean for contiguous blocks and for balanced_placement from the loads of an earlier
    batch (a calibration batch from the same router preference), both measured on the same batch."""
    rows = []
    for label, zipf in (("uniform", None), ("skewed zipf 1.2", 1.2)):
        per_expert = torch.bincount(_routing(tokens, experts, top_k, zipf).flatten(), minlength=experts).double()
        observed = torch.bincount(_routing(tokens, experts, top_k, zipf, sample_seed=1).flatten(),
                                  minlength=experts).double()
        for ep in EP_SIZES:
            per_rank = rank_loads(per_expert, contiguous_placement(experts, ep))
            balanced = rank_loads(per_expert, balanced_placement(observed, ep))
            rows.append({"case": f"load {label} E={experts} k={top_k} T={tokens} ep={ep}",
                         "rows_max": int(per_rank.max()), "rows_mean": float(per_rank.mean()),
                         "max_over_mean": float(per_rank.max() / per_rank.mean()),
                         "balanced_rows_max": int(balanced.max()),
                         "balanced_max_over_mean": float(balanced.max() / balanced.mean())})
    return rows


def _param_bytes(params: object) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _memory(tiny: HybridLM) -> dict[str, int]:
    whole = _param_bytes(tiny.parameters())
    routed = sum(_param_bytes(m.experts.parameters()) for m in tiny.modules() if isinstance(m, DeepSeekMoE))
    shard_experts(tiny, dist.group.WORLD)
    local = sum(_param_bytes(m.parameters()) for m in tiny.modules() if isinstance(m, EPExperts))
    return {"whole_bytes": whole, "routed_bytes": routed, "rank_bytes": _param_bytes(tiny.parameters()),
            "rank_routed_bytes": local, "replicated_bytes": whole - routed}


def rank_work(tokens: int, repeat: int) -> dict[str, Any]:
    """In a launched rank: memory of the sharded tiny reference model, then the side-by-side layer timing."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    memory = _memory(HybridLM(HybridConfig.named("tiny")).eval())
    config = HybridConfig.named("small")
    torch.manual_seed(0)
    whole = DeepSeekMoE(config).eval()
    torch.nn.init.normal_(whole.gate.weight, std=config.initializer_range)   # as HybridLM does (it is empty)
    parent = torch.nn.Module()
    parent.mlp = DeepSeekMoE(config).eval()
    parent.mlp.load_state_dict(whole.state_dict())
    shard_experts(parent, dist.group.WORLD)
    x = torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(dist.get_rank()))
    w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in whole.experts]).detach()
    w2 = torch.stack([e.down_proj.weight for e in whole.experts]).detach()

    def one_process() -> torch.Tensor:
        weights, ids = whole.gate(x)
        return torch.ops.ascend_dsa.fused_moe(x, w13, w2, weights, ids) + whole.shared_experts(x)

    with torch.no_grad():
        torch.testing.assert_close(parent.mlp(x), one_process(), rtol=1e-4, atol=1e-5)
        times = time_side_by_side({"one_process": one_process, "ep2": lambda: parent.mlp(x)}, repeat=repeat)
    return {"memory": memory, "ms": {name: seconds * 1e3 for name, seconds in times.items()}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokens = 64 if getattr(args, "quick", False) else 512
    repeat = getattr(args, "repeat", None) or (6 if getattr(args, "quick", False) else 20)
    rows = bytes_rows() + load_rows()
    with progress.step(f"bench ep: two gloo ranks, one MoE layer of T={tokens} tokens"):
        ranks = launch(rank_work, 2, args=(tokens, repeat), timeout_s=600.0)
    for rank, result in enumerate(ranks):
        memory = result["memory"]
        rows.append({"case": f"memory reference tiny ep=2 rank {rank}", **memory,
                     "rank_routed_fraction": memory["rank_routed_bytes"] / memory["routed_bytes"]})
    for rank, result in enumerate(ranks):
        rows.append({"case": f"time MoE layer small T={tokens} rank {rank}",
                     "one_process_ms": result["ms"]["one_process"], "ep2_ms": result["ms"]["ep2"],
                     "ep2_over_one_process": result["ms"]["ep2"] / result["ms"]["one_process"]})
    notes = ["2 ranks on this machine share its cores with everything else; each rank runs one thread, and "
             "both ranks run the one-process layer too (side by side, alternating), so the times compare the "
             "same core count. At EP=2 a rank's experts get as many rows as the rank routes (the expert FLOPs "
             "per rank are the same both ways), so on a CPU the EP form can only add the two all-to-alls and "
             "their bookkeeping (gloo over loopback TCP, index work in torch): this run shows the EP layer's "
             "correctness, its memory split and its overheads, not what HCCL/MC2 on an Ascend EP group brings "
             "(each card reads 1/EP of the expert weights).",
             "load max/mean: rows_* for contiguous expert blocks, balanced_* for experts placed by the loads of "
             "another batch from the same router (shard_experts(..., placement=balanced_placement(loads, ep)), "
             "EPLB-style packing without replicas); a single expert hotter than the mean (Zipf at EP=8) bounds "
             "what any placement without replicas can reach."]
    return {"suite": "ep", "rows": rows, "notes": notes}


def _value(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def print_text(result: dict[str, Any]) -> None:
    """One line per row (the rows of the four measurements have different columns), then the notes."""
    print("ascend-dsa bench ep")
    for row in result["rows"]:
        fields = ", ".join(f"{key} {_value(value)}" for key, value in row.items() if key != "case")
        print(f"  {row['case']}: {fields}")
    for note in result["notes"]:
        print(f"- {note}")

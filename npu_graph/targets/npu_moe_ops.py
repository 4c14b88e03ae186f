"""The MoE lowerings of the NPU program: one-card `fused_moe`, and the expert-parallel layer
(`moe_dispatch` -> `grouped_swiglu` -> `moe_combine`) as torch_npu's MC2 pair around grouped GEMMs.

EP layers become `npu_moe_distribute_dispatch` / `npu_moe_distribute_combine` (the v1 pair: its expand_idx
[BS·K] is ours) when the pinned op accepts the case (npu_signatures: EP sizes 8..288, at most 512 experts,
H <= 7168 and a multiple of 32, K <= 16, BS <= 512); otherwise both stay the all_to_all composite, which runs
over HCCL as it does over gloo, labelled with the reason. The MC2 ops take the HCCL communicator name of the EP
group, so the program computes it once at load (`HCCL_<group>`, get_hccl_comm_name with the global rank).
"""
from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from npu_graph.targets.npu_contract import Arg
from npu_graph.targets.npu_ops import Emission, Lowering, bound_args, half_dtype
from npu_graph.targets.npu_signatures import (
    MC2_EP_SIZES,
    MC2_MAX_EXPERTS,
    MC2_MAX_HIDDEN,
    MC2_MAX_TOKENS,
    MC2_MAX_TOP_K,
)

_HALF = "the pinned op takes float16/bfloat16"
_IDS = "expert ids are int32"


def _grouped(lo: Lowering, rows: str, weight: Any, dtype: torch.dtype, counts: str) -> str:
    w = lo.names.text(weight)
    args = [Arg(f"[{rows}]", "tensors", dtypes=(dtype,)), Arg(f"[{w}.transpose(1, 2)]", "tensors", dtypes=(dtype,))]
    kwargs = {"group_list": Arg.tensor(counts, torch.int64), "group_list_type": 1, "group_type": 0, "split_item": 2}
    return f"{lo.call('torch_npu.npu_grouped_matmul', args, kwargs)}[0]"


def _fused_moe(lo: Lowering, a: dict[str, Any]) -> Emission:
    x, ids = lo.tensor(a["x"]), lo.tensor(a["topk_ids"], torch.int32, _IDS)
    experts = a["w13"].meta["val"].shape[0]
    lo.line("# dispatch -> grouped GEMMs -> SwiGLU -> combine (vllm-ascend's dropless path; pairing unverified)")
    routed = lo.call("torch_npu.npu_moe_init_routing_v2", [x, ids], {
        "active_num": Arg(f"{x.text}.shape[0] * {ids.text}.shape[1]", "expr"), "expert_num": lo.value(experts),
        "expert_tokens_num_type": 1, "expert_tokens_num_flag": True, "quant_mode": -1,
        "active_expert_range": Arg(f"[0, {lo.names.text(experts)}]", "expr"), "row_idx_type": 0})
    hidden = _grouped(lo, f"{routed}[0]", a["w13"], x.dtype, f"{routed}[2]")
    act = lo.call("torch_npu.npu_swiglu", [Arg.tensor(hidden, x.dtype), -1], {})
    down = _grouped(lo, act, a["w2"], x.dtype, f"{routed}[2]")
    weights = lo.tensor(a["topk_weights"], x.dtype, "routing weights share the rows' dtype")
    out = lo.call("torch_npu.npu_moe_finalize_routing", [
        Arg.tensor(down, x.dtype), Arg.literal(None), Arg.literal(None), Arg.literal(None), weights,
        Arg.tensor(f"{routed}[1]", torch.int32), ids, lo.value(0)], {})
    return lo.assign(out)


def _grouped_swiglu(lo: Lowering, a: dict[str, Any]) -> Emission:
    x = lo.tensor(a["x"])
    counts = lo.tensor(a["group_list"], torch.int64, "npu_grouped_matmul takes an int64 group_list")
    hidden = _grouped(lo, x.text, a["w13"], x.dtype, counts.text)
    act = lo.call("torch_npu.npu_swiglu", [Arg.tensor(hidden, x.dtype), -1], {})
    down = _grouped(lo, act, a["w2"], x.dtype, counts.text)
    lo.line("# note: rows past sum(group_list) (dispatch's padding) are not zeroed here; combine reads only valid rows")
    return lo.assign(down)


def mc2_unsupported(tokens: Any, hidden: Any, top_k: Any, world: int, experts: int) -> str:
    """Why the pinned MC2 pair cannot take this EP layer ("" when it can); symbolic sizes are left to run time."""
    if world not in MC2_EP_SIZES:
        return (f"npu_moe_distribute_dispatch/combine take ep_world_size in {list(MC2_EP_SIZES)} (A2: 16, 32, 64); "
                f"EP={world} runs the all_to_all composite (over HCCL on Ascend)")
    limits = (("moe_expert_num", experts, MC2_MAX_EXPERTS, 1), ("hidden size H", hidden, MC2_MAX_HIDDEN, 32),
              ("top-k K", top_k, MC2_MAX_TOP_K, 1), ("tokens per rank BS", tokens, MC2_MAX_TOKENS, 1))
    for what, value, most, multiple in limits:
        if isinstance(value, int) and not (0 < value <= most and value % multiple == 0):
            unit = f" and a multiple of {multiple}" if multiple > 1 else ""
            return (f"npu_moe_distribute_dispatch/combine take {what} in (0, {most}]{unit}; got {value}: the "
                    f"all_to_all composite runs instead")
    return ""


def _dispatch_limits(args: dict[str, Any]) -> str:
    x, ids = args["x"].meta["val"], args["expert_ids"].meta["val"]
    return mc2_unsupported(x.shape[0], x.shape[1], ids.shape[1], args["ep_world_size"], args["moe_expert_num"])


def _hccl_group(lo: Lowering, group_name: str) -> Arg:
    """The HCCL communicator name of torch process group `group_name`, a constant of the program."""
    expr = (f"torch.distributed.distributed_c10d._resolve_process_group({group_name!r})"
            f'._get_backend(torch.device("npu")).get_hccl_comm_name(torch.distributed.get_rank())')
    return lo.constant("HCCL_" + re.sub(r"\W", "_", group_name).upper(), expr)


def _ep_args(lo: Lowering, a: dict[str, Any]) -> list[Arg]:
    """group_ep, ep_world_size, ep_rank_id, moe_expert_num as MC2 takes them."""
    return [_hccl_group(lo, a["group_ep"]), *(lo.value(a[k]) for k in ("ep_world_size", "ep_rank_id",
                                                                        "moe_expert_num"))]


def _moe_dispatch(lo: Lowering, a: dict[str, Any]) -> Emission | str:
    reason = _dispatch_limits(a)
    if reason:
        return reason
    original, dtype = a["x"].meta["val"].dtype, half_dtype(a["x"])
    x, ids = lo.tensor(a["x"], dtype, _HALF), lo.tensor(a["expert_ids"], torch.int32, _IDS)
    quant = a["quant_mode"]
    raw = lo.call("torch_npu.npu_moe_distribute_dispatch", [x, ids, *_ep_args(lo, a)],
                  {"quant_mode": quant, "global_bs": a["global_bs"], "expert_token_nums_type": 1})
    expand = f"{raw}[0]" if quant == 2 or original == dtype else f"{raw}[0].to({original})"
    scales = f"{raw}[1]" if quant == 2 else f"{raw}[0].new_empty(0, dtype=torch.float32)"
    lo.line("# note: expand_idx and ep_recv_counts are MC2's bookkeeping (counts as prefix sums): combine reads them")
    return lo.assign(f"({expand}, {scales}, {raw}[2], {raw}[3], {raw}[4])")


def _dispatch_of(expand_idx: Any) -> torch.fx.Node | None:
    """The moe_dispatch node whose expand_idx output `expand_idx` is, if it is one."""
    if not (isinstance(expand_idx, torch.fx.Node) and expand_idx.target is operator.getitem):
        return None
    source = expand_idx.args[0]
    return source if getattr(source, "target", None) is torch.ops.ascend_dsa.moe_dispatch.default else None


def _moe_combine(lo: Lowering, a: dict[str, Any]) -> Emission | str:
    dispatch = _dispatch_of(a["expand_idx"])
    if dispatch is None:
        return ("moe_combine's expand_idx is not a moe_dispatch output of this graph; MC2 combine needs that "
                "dispatch's bookkeeping and global_bs")
    sent = bound_args(dispatch)
    reason = _dispatch_limits(sent)
    if reason:
        return f"its moe_dispatch stays composite: {reason}"
    dtype, out_dtype = half_dtype(a["expand_x"]), lo.node.meta["val"].dtype
    args = [lo.tensor(a["expand_x"], dtype, _HALF), lo.tensor(a["expert_ids"], torch.int32, _IDS),
            lo.tensor(a["expand_idx"], torch.int32), lo.tensor(a["ep_send_counts"], torch.int32),
            lo.tensor(a["expert_scales"], torch.float32, "MC2 takes float32 expert_scales"), *_ep_args(lo, a)]
    raw = lo.call("torch_npu.npu_moe_distribute_combine", args, {"global_bs": sent["global_bs"]})
    return lo.assign(raw if out_dtype == dtype else f"{raw}.to({out_dtype})")


MOE_LOWERINGS: dict[str, Callable[[Lowering, dict[str, Any]], Emission | str]] = {
    "fused_moe": _fused_moe,
    "grouped_swiglu": _grouped_swiglu,
    "moe_dispatch": _moe_dispatch,
    "moe_combine": _moe_combine,
}

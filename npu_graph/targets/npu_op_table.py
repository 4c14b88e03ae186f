"""The lowering of each ascend_dsa op to the pinned torch_npu op it mirrors (see npu_signatures for sources).

A lowering returns the Emission for its node, or a string: the reason this case stays a labelled composite.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from npu_graph.targets.npu_contract import Arg
from npu_graph.targets.npu_kda import KDA_LOWERINGS
from npu_graph.targets.npu_moe_ops import MOE_LOWERINGS
from npu_graph.targets.npu_ops import Emission, Lowering, Names, bound_args, composite, half_dtype, used_outputs
from npu_graph.targets.npu_signatures import NO_COUNTERPART

_INT32 = "the pinned op takes int32 lengths and block tables"
_HALF = "the pinned op takes float16/bfloat16"


def _dequant(lo: Lowering, value: Any, scale: Any, op: str, block: int) -> Arg:
    """Composite dequantization of a quantized (fp8 or int8) input to bfloat16 before a pinned op that takes only
    half inputs."""
    name = lo.names.fresh(f"{lo.node.name}_dq")
    lo.line(f"# composite: quantized input dequantized to bfloat16; {NO_COUNTERPART[op]}")
    lo.line(f"{name} = torch.ops.ascend_dsa.{op}.default({lo.names.text(value)}, {lo.names.text(scale)}, "
            f"block_size={block}, dst_type=torch.bfloat16)")
    return Arg.tensor(name, torch.bfloat16)


def _lengths(lo: Lowering, a: dict[str, Any], *names: str) -> dict[str, Arg]:
    return {n: lo.tensor(a[n], torch.int32, _INT32) for n in names}


_NO_KEY_STARTS = "key_starts (a left-padded batch) has no torch_npu counterpart"


def _int8_lightning_indexer(lo: Lowering, a: dict[str, Any]) -> Emission | str:
    """Per-token int8 query and paged key: npu_quant_lightning_indexer (mode 0), which returns the indices only."""
    if a["layout_key"] != "PA_BSND" or a["key_scale"] is None or a["key"].meta["val"].dtype != torch.int8:
        return "npu_quant_lightning_indexer takes an int8 paged key (PA_BSND) with its scales"
    if a["return_value"] or 1 in used_outputs(lo.node):
        return "npu_quant_lightning_indexer returns no sparse_values"
    scales = []
    for name in ("query_scale", "key_scale"):
        lo.line(f"# adapt: {name} [..., 1] fp32 -> [...] fp16 (the pinned op's dequant scale)")
        squeezed = lo.names.fresh(f"{lo.node.name}_{name}")
        lo.line(f"{squeezed} = {lo.names.text(a[name])}.squeeze(-1).to(torch.float16)")
        scales.append(Arg.tensor(squeezed, torch.float16))
    args = [lo.tensor(a["query"]), lo.tensor(a["key"]), lo.tensor(a["weights"], torch.float16, "the pinned op takes "
                                                                 "float16 weights"), *scales]
    kwargs = {**_lengths(lo, a, "actual_seq_lengths_query", "actual_seq_lengths_key", "block_table"),
              "query_quant_mode": 0, "key_quant_mode": 0, "layout_query": a["layout_query"],
              "layout_key": a["layout_key"], "sparse_count": a["sparse_count"], "sparse_mode": a["sparse_mode"]}
    raw = lo.call("torch_npu.npu_quant_lightning_indexer", args, kwargs)
    return lo.assign(f"({raw}, None)")


def _dequantized_operand(lo: Lowering, x: Any, scale: Any) -> Any:
    """An indexer operand as npu_lightning_indexer takes it: MXFP8 or int8 codes dequantized to bfloat16 (composite),
    a float one as it is."""
    if scale is None:
        return x
    if x.meta["val"].dtype == torch.int8:
        return _dequant(lo, x, scale, "dequant_block", x.meta["val"].shape[-1])
    return _dequant(lo, x, scale, "dequant_mx", 32)


def _lightning_indexer(lo: Lowering, a: dict[str, Any]) -> Emission | str:
    if a.get("key_starts") is not None:
        return _NO_KEY_STARTS
    if a["query_scale"] is not None and a["query"].meta["val"].dtype == torch.int8:
        emitted = _int8_lightning_indexer(lo, a)
        if not isinstance(emitted, str):
            return emitted
        lo.line(f"# {emitted}: the int8 operands are dequantized for npu_lightning_indexer")
    query = _dequantized_operand(lo, a["query"], a["query_scale"])
    key = _dequantized_operand(lo, a["key"], a["key_scale"])
    dtype = torch.bfloat16 if a["query_scale"] is not None or a["key_scale"] is not None else half_dtype(a["query"])
    args = [lo.tensor(query, dtype, _HALF), lo.tensor(key, dtype, _HALF), lo.tensor(a["weights"], dtype, _HALF)]
    kwargs = {**_lengths(lo, a, "actual_seq_lengths_query", "actual_seq_lengths_key", "block_table"),
              "layout_query": a["layout_query"], "layout_key": a["layout_key"], "sparse_count": a["sparse_count"],
              "sparse_mode": a["sparse_mode"], "return_value": bool(a["return_value"] or 1 in used_outputs(lo.node))}
    return lo.assign(lo.call("torch_npu.npu_lightning_indexer", args, kwargs))


def _sparse_flash_attention(lo: Lowering, a: dict[str, Any]) -> Emission | str:
    if a.get("key_starts") is not None:
        return _NO_KEY_STARTS
    out_dtype, dtype = lo.node.meta["val"][0].dtype, half_dtype(a["query"])
    key, value = a["key"], a["value"]
    if a["key_scale"] is not None:
        key = _dequant(lo, key, a["key_scale"], "dequant_block", 128)
        value = key if a["value"] is a["key"] else _dequant(lo, value, a["value_scale"], "dequant_block", 128)
    key_rope = a["key_rope"]
    if a.get("key_rope_scale") is not None:     # one scale per token over the rope dim
        key_rope = _dequant(lo, key_rope, a["key_rope_scale"], "dequant_block", key_rope.meta["val"].shape[-1])
    args = [lo.tensor(x, dtype, _HALF) for x in (a["query"], key, value)]
    args += [lo.tensor(a["sparse_indices"], torch.int32, _INT32), lo.value(a["scale_value"])]
    lse = bool(a["return_softmax_lse"]) or bool(used_outputs(lo.node) & {1, 2})
    kwargs = {"block_table": lo.tensor(a["block_table"], torch.int32, _INT32),
              **_lengths(lo, a, "actual_seq_lengths_query", "actual_seq_lengths_kv"),
              "query_rope": lo.tensor(a["query_rope"], dtype, _HALF),
              "key_rope": lo.tensor(key_rope, dtype, _HALF),
              "sparse_block_size": a["sparse_block_size"], "layout_query": a["layout_query"],
              "layout_kv": a["layout_kv"], "sparse_mode": a["sparse_mode"], "attention_mode": 2,
              "return_softmax_lse": lse}
    raw = lo.call("torch_npu.npu_sparse_flash_attention", args, kwargs)
    out = f"{raw}[0]" if out_dtype == dtype else f"{raw}[0].to({out_dtype})"
    stats = f"{raw}[1].squeeze(1), {raw}[2].squeeze(1)" if lse else "None, None"
    if lse:
        lo.line("# adapt: softmax_max/sum [B,N2=1,S1,N1] -> [B,S1,N1]")
    return lo.assign(f"({out}, {stats})")


def _dynamic_mx_quant(lo: Lowering, a: dict[str, Any]) -> Emission | str:
    x = a["x"]
    if a["axis"] not in (-1, x.meta["val"].dim() - 1):
        return "npu_dynamic_mx_quant is lowered here only along the last axis"
    dst = a["dst_type"] if isinstance(a["dst_type"], torch.dtype) else lo.node.meta["val"][0].dtype
    block = a["block_size"]
    raw = lo.call("torch_npu.npu_dynamic_mx_quant", [lo.tensor(x, half_dtype(x), _HALF)],
                  {"axis": -1, "round_mode": "rint", "dst_type": dst, "block_size": block, "scale_alg": 0})
    lo.line("# adapt: mxscale [..., ceil(n/64), 2] -> [..., ceil(n/32)]")
    groups = f"({lo.names.text(x)}.shape[-1] + {block - 1}) // {block}"
    return lo.assign(f"({raw}[0], {raw}[1].flatten(-2)[..., :{groups}])")


_BLOCK_QUANT_COLUMNS = (64, 128, 192, 256)     # npu_dynamic_block_quant's col_block_size choices


def _dynamic_block_quant(lo: Lowering, a: dict[str, Any]) -> Emission | str:
    if a["scale_fmt"] != "fp32":
        return "ue8m0 (power-of-two) block scales have no npu_dynamic_block_quant option in torch_npu 7.3.0"
    if a["block_size"] not in _BLOCK_QUANT_COLUMNS:
        return f"npu_dynamic_block_quant takes column blocks of {_BLOCK_QUANT_COLUMNS}, not {a['block_size']}"
    dst_type = lo.node.meta["val"][0].dtype
    x = lo.names.text(a["x"])
    flat = lo.names.fresh(f"{lo.node.name}_2d")
    lo.line(f"{flat} = {x}.reshape(-1, {x}.shape[-1])  # adapt: npu_dynamic_block_quant takes 2-D x")
    top = 127 if dst_type == torch.int8 else 448
    lo.line(f"# note: blocks with amax < 1e-4 get scale amax/{top} here, max(amax, 1e-4)/{top} on the CPU target")
    source = Arg.tensor(flat, a["x"].meta["val"].dtype)
    raw = lo.call("torch_npu.npu_dynamic_block_quant", [lo.tensor(source, half_dtype(a["x"]), _HALF)],
                  {"min_scale": 0.0, "round_mode": "rint", "dst_type": dst_type, "row_block_size": 1,
                   "col_block_size": a["block_size"]})
    return lo.assign(f"({raw}[0].view({x}.shape), {raw}[1].view({x}.shape[:-1] + (-1,)))")


def _moe_gating_top_k(lo: Lowering, a: dict[str, Any]) -> Emission | str:
    if a["norm_type"] == 0 and a["renorm"] == 1:
        return "softmax routing renormalized after top-k (renorm=1): torch_npu 7.3.0 takes only renorm=0"
    x = lo.tensor(a["x"])
    kwargs = {"bias": lo.tensor(a["bias"], x.dtype, "bias shares x's dtype"), "k_group": a["k_group"],
              "group_count": a["group_count"], "group_select_mode": a["group_select_mode"], "renorm": 0,
              "norm_type": a["norm_type"], "out_flag": a["out_flag"],
              "routed_scaling_factor": a["routed_scaling_factor"], "eps": a["eps"]}
    return lo.assign(lo.call("torch_npu.npu_moe_gating_top_k", [x, a["k"]], kwargs))


def _rms_norm(lo: Lowering, a: dict[str, Any]) -> Emission:
    x = lo.tensor(a["x"])
    gamma = lo.tensor(a["gamma"], x.dtype, "npu_rms_norm takes gamma in x's dtype")
    return lo.assign(lo.call("torch_npu.npu_rms_norm", [x, gamma, a["epsilon"]], {}))


def _add_rms_norm(lo: Lowering, a: dict[str, Any]) -> Emission:
    x1 = lo.tensor(a["x1"])
    args = [x1, lo.tensor(a["x2"], x1.dtype), lo.tensor(a["gamma"], x1.dtype, "npu_add_rms_norm takes gamma in "
                                                                                "x's dtype"), lo.value(a["epsilon"])]
    return lo.assign(lo.call("torch_npu.npu_add_rms_norm", args, {}))


def _rotary_mul(lo: Lowering, a: dict[str, Any]) -> Emission:
    x = lo.tensor(a["input"])
    r1, r2 = (lo.tensor(a[name], x.dtype, "npu_rotary_mul takes r1/r2 in input's dtype") for name in ("r1", "r2"))
    return lo.assign(lo.call("torch_npu.npu_rotary_mul", [x, r1, r2, a["rotary_mode"]], {}))


LOWERINGS: dict[str, Callable[[Lowering, dict[str, Any]], Emission | str]] = {
    "lightning_indexer": _lightning_indexer,
    "sparse_flash_attention": _sparse_flash_attention,
    "dynamic_mx_quant": _dynamic_mx_quant,
    "dynamic_block_quant": _dynamic_block_quant,
    "moe_gating_top_k": _moe_gating_top_k,
    "rms_norm": _rms_norm,
    "add_rms_norm": _add_rms_norm,
    "rotary_mul": _rotary_mul,
    **MOE_LOWERINGS,
    **KDA_LOWERINGS,
}


def lower_node(node: torch.fx.Node, names: Names) -> Emission:
    """Program lines for one ascend_dsa node: mapped to torch_npu, or composite with its reason."""
    name = node.target._opname
    lowering = LOWERINGS.get(name)
    if lowering is None:
        return composite(node, names, NO_COUNTERPART.get(name, f"no torch_npu counterpart for {name}"))
    result = lowering(Lowering(node, names), bound_args(node))
    return composite(node, names, result) if isinstance(result, str) else result

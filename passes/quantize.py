"""quantize: apply the hierarchical quantization policy (npu_graph.quant_policy) to the fused DSA operators.

- `lightning_indexer`: query and key become MXFP8 through explicit `ascend_dsa.dynamic_mx_quant` nodes whose
  codes and E8M0 scales feed the op (query/key + query_scale/key_scale); with the int8 format, per-token int8
  through `ascend_dsa.dynamic_block_quant` (dst_type=int8, one block per row: one fp32 scale per token and head).
- `sparse_flash_attention`: key and value become FP8 block-128 through `ascend_dsa.dynamic_block_quant`
  (key_scale/value_scale); one quantization serves both when value is the key (MLA's latent). A RoPE key the
  cache stores as FP8 (one fp32 scale per token over the rope dim) is passed as codes and key_rope_scale; a float
  one stays as it is.
An operand that is already a stored quantized cache read through `dequant_mx` / `dequant_block` (the
reference model's cache built with kv_dtype=float8_e4m3fn, or index_dtype=int8 for int8 indexer keys) is passed
as its codes and scales: the op reads
FP8 directly and the whole-cache dequantization disappears; the quantization then lives in the cache write.
Operands whose last dim is not a multiple of the group are zero padded to one (dot products and the kept
output columns are unchanged). Nothing is done with quant="none"; the `quantized` summary lists every tensor.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.matching.meta_refresh import meta_snapshot, refresh_meta
from npu_graph.passes.matching.values import val
from npu_graph.quant_policy import EXPECTED_ERROR, KV_TILE, MX_GROUP, indexer_entry, kv_entry, resolve_policy

NAME = "quantize"
INFERENCE_ONLY = True

aten = torch.ops.aten
ops = torch.ops.ascend_dsa
FP8 = torch.float8_e4m3fn
INT8 = torch.int8


def _bind(node: torch.fx.Node) -> dict[str, Any]:
    """Every argument of an OpOverload call by schema name (defaults omitted)."""
    schema = node.target._schema.arguments
    bound = {arg.name: value for arg, value in zip(schema, node.args)}
    bound.update(node.kwargs)
    return bound


def _rebind(node: torch.fx.Node, bound: dict[str, Any]) -> None:
    """Write `bound` back: positional arguments up to the last one set, keyword-only ones as kwargs."""
    schema = node.target._schema.arguments
    positional = [a for a in schema if not a.kwarg_only]
    last = max((i for i, a in enumerate(positional) if bound.get(a.name) is not None), default=-1)
    node.args = tuple(bound.get(a.name, a.default_value if a.has_default_value() else None)
                      for a in positional[:last + 1])
    node.kwargs = {a.name: bound[a.name] for a in schema if a.kwarg_only and a.name in bound}


def _pad_last(graph: torch.fx.Graph, x: torch.fx.Node, group: int) -> torch.fx.Node:
    pad = -val(x).shape[-1] % group
    return x if pad == 0 else graph.call_function(aten.constant_pad_nd.default, (x, [0, pad], 0.0))


def _split(graph: torch.fx.Graph, op: Any, x: torch.fx.Node, kwargs: dict[str, Any]
           ) -> tuple[torch.fx.Node, torch.fx.Node]:
    q = graph.call_function(op, (x,), kwargs)
    return graph.call_function(operator.getitem, (q, 0)), graph.call_function(operator.getitem, (q, 1))


def _stored(x: object, op: Any, block: int, codes: torch.dtype = FP8) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(codes, scales) when `x` dequantizes a stored quantized tensor of `codes` along its last dim in groups of
    `block`."""
    if not isinstance(x, torch.fx.Node) or x.target is not op:
        return None
    bound = _bind(x)
    if bound.get("block_size", block) != block or bound.get("axis", -1) not in (-1, val(x).dim() - 1) \
            or val(bound["y"]).dtype != codes:
        return None
    return bound["y"], bound["scale"]


def _quant_indexer(graph: torch.fx.Graph, node: torch.fx.Node, form: str) -> list[dict[str, Any]]:
    bound = _bind(node)
    if val(bound["query"]).dtype in (FP8, INT8):
        return []
    if form == "int8":
        return _quant_indexer_int8(graph, node, bound)
    depth = val(bound["query"]).shape[-1]
    padded = depth if depth % MX_GROUP else None
    with graph.inserting_before(node):
        bound["query"], bound["query_scale"] = _split(graph, ops.dynamic_mx_quant.default,
                                                      _pad_last(graph, bound["query"], MX_GROUP), {})
        entries = [indexer_entry(node.name, "query", "per call", padded)]
        stored = _stored(bound["key"], ops.dequant_mx.default, MX_GROUP)
        if stored is not None:
            bound["key"], bound["key_scale"] = stored
            entries.append(indexer_entry(node.name, "key", "stored cache"))
        else:
            bound["key"], bound["key_scale"] = _split(graph, ops.dynamic_mx_quant.default,
                                                      _pad_last(graph, bound["key"], MX_GROUP), {})
            entries.append(indexer_entry(node.name, "key", "per call", padded))
    _rebind(node, bound)
    return entries


def _quant_indexer_int8(graph: torch.fx.Graph, node: torch.fx.Node, bound: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-token int8 query and key (one block per row: no padding); a stored int8 key cache passes its codes."""
    depth = val(bound["query"]).shape[-1]
    options = {"block_size": depth, "dst_type": INT8}
    with graph.inserting_before(node):
        bound["query"], bound["query_scale"] = _split(graph, ops.dynamic_block_quant.default, bound["query"], options)
        entries = [indexer_entry(node.name, "query", "per call", form="int8", depth=depth)]
        stored = _stored(bound["key"], ops.dequant_block.default, depth, INT8)
        if stored is not None:
            bound["key"], bound["key_scale"] = stored
            entries.append(indexer_entry(node.name, "key", "stored cache", form="int8", depth=depth))
        else:
            bound["key"], bound["key_scale"] = _split(graph, ops.dynamic_block_quant.default, bound["key"], options)
            entries.append(indexer_entry(node.name, "key", "per call", form="int8", depth=depth))
    _rebind(node, bound)
    return entries


def _kv_operand(graph: torch.fx.Graph, x: torch.fx.Node, scale_fmt: str
                ) -> tuple[torch.fx.Node, torch.fx.Node, str]:
    stored = _stored(x, ops.dequant_block.default, KV_TILE)
    if stored is not None:
        return (*stored, "stored cache")
    codes, scale = _split(graph, ops.dynamic_block_quant.default, _pad_last(graph, x, KV_TILE),
                          {"block_size": KV_TILE, "scale_fmt": scale_fmt})
    return codes, scale, "per call"


def _slice_output(graph: torch.fx.Graph, node: torch.fx.Node, width: int) -> None:
    """Consumers of output 0 of `node` (padded to a whole tile) see only its first `width` columns."""
    for user in list(node.users):
        if user.target is operator.getitem and user.args[1] == 0:
            with graph.inserting_after(user):
                kept = graph.call_function(aten.slice.Tensor, (user, -1, 0, width))
            user.replace_all_uses_with(kept, delete_user_cb=lambda n, kept=kept: n is not kept)


def _stored_rope(bound: dict[str, Any], node_name: str, scale_fmt: str) -> list[dict[str, Any]]:
    """The RoPE key as the op's codes and key_rope_scale when it reads a stored FP8 cache (one scale per token)."""
    rope = bound.get("key_rope")
    stored = None if rope is None else _stored(rope, ops.dequant_block.default, val(rope).shape[-1])
    if stored is None:
        return []
    bound["key_rope"], bound["key_rope_scale"] = stored
    return [kv_entry(node_name, "key_rope", "stored cache", scale_fmt, group=val(rope).shape[-1])]


def _quant_kv(graph: torch.fx.Graph, node: torch.fx.Node, scale_fmt: str) -> list[dict[str, Any]]:
    bound = _bind(node)
    key, value = bound["key"], bound["value"]
    if val(key).dtype == FP8 or val(key).shape[-1] != val(value).shape[-1]:
        return []
    width = val(key).shape[-1]
    padded = width if width % KV_TILE else None
    with graph.inserting_before(node):
        bound["key"], bound["key_scale"], where = _kv_operand(graph, key, scale_fmt)
        entries = [kv_entry(node.name, "key", where, scale_fmt, padded)]
        if value is key:
            bound["value"], bound["value_scale"] = bound["key"], bound["key_scale"]
        else:
            bound["value"], bound["value_scale"], where = _kv_operand(graph, value, scale_fmt)
        entries.append(kv_entry(node.name, "value", where, scale_fmt, padded))
        if padded is not None:
            bound["query"] = _pad_last(graph, bound["query"], KV_TILE)
        entries += _stored_rope(bound, node.name, scale_fmt)
    _rebind(node, bound)
    if padded is not None:
        _slice_output(graph, node, width)
    return entries


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    policy = resolve_policy(ctx.config.quant)
    if not policy.active:
        return PassResult(changed=False)
    entries: list[dict[str, Any]] = []
    before = meta_snapshot(gm)
    for node in list(gm.graph.nodes):
        if node.target is ops.lightning_indexer.default and policy.indexer != "none":
            entries += _quant_indexer(gm.graph, node, policy.indexer)
        elif node.target is ops.sparse_flash_attention.default and policy.kv == "fp8_block128":
            entries += _quant_kv(gm.graph, node, policy.scale_fmt)
    if entries:
        gm.graph.eliminate_dead_code()
        refresh_meta(gm, since=before)
    summary = {"policy": policy.to_json(), "tensors": entries, "expected_error": EXPECTED_ERROR}
    ops_done = sorted({e["op"] for e in entries})
    return PassResult(changed=bool(entries), stats={"quantized": len(entries), "ops": ops_done},
                      summary={"quantized": summary})

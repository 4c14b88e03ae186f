"""What `ascend-dsa bench context` times: one DeepSeek-V3.2-sized layer (npu_graph.models.context_layer) under each
row's execution, its caches at a given context, and the FP8 indexer's top-k overlap with the bf16 one.

Rows: dense MLA (`dense_*`, no indexer) and DSA (`dsa_*`) in eager and under Inductor, DSA under ascend_dsa
(`ascend_dsa`) and under ascend_dsa with the FP8 quant policy (`ascend_dsa_fp8`, quant="dsa" with
quant.indexer="int8": FP8 latent cache with block-128 scales, FP8 RoPE key with one scale per token, and per-token
int8 indexer keys, the form Ascend A2/A3's quantized indexer runs, at the bytes of MXFP8 keys; the FP8 points also
report the top-k overlap MXFP8 indexer keys would give, DeepSeek's own format). Every compiled row calls the
layer from a code object of its own (Dynamo keeps compiled entries per code object; sharing one would make each row
check the others' guards).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

import npu_graph
from npu_graph.models.cache import FP8, HybridCache
from npu_graph.models.config import HybridConfig
from npu_graph.models.context_layer import ContextLayer

ROWS = ("dense_eager", "dense_inductor", "dsa_eager", "dsa_inductor", "ascend_dsa", "ascend_dsa_fp8")
FP8_ROWS = frozenset({"ascend_dsa_fp8"})
FP8_POLICY = {"quant": "dsa", "quant.indexer": "int8"}
MX_GROUP = 32

Step = Callable[[torch.Tensor, HybridCache], torch.Tensor]


def is_sparse(row: str) -> bool:
    return not row.startswith("dense")


def _own_frame(layer: ContextLayer, sparse: bool) -> Step:
    namespace: dict[str, Any] = {}
    exec("def step(x, cache):\n    return layer(x, cache, sparse)\n", {"layer": layer, "sparse": sparse}, namespace)
    return namespace["step"]


def row_steps(layer: ContextLayer, rows: tuple[str, ...] | None = None) -> dict[str, Step]:
    """Each row's step function (compiled lazily by its first call), of `rows` (default: every row)."""
    steps: dict[str, Step] = {}
    for row in ROWS if rows is None else rows:
        sparse = is_sparse(row)
        if row.endswith("_eager"):
            steps[row] = _own_frame(layer, sparse)
        elif row.endswith("_inductor"):
            steps[row] = torch.compile(_own_frame(layer, sparse), backend="inductor")
        else:
            options = {"cache": False, **(FP8_POLICY if row in FP8_ROWS else {})}
            backend = npu_graph.Backend(npu_graph.CompilerConfig.from_options(options))
            steps[row] = torch.compile(_own_frame(layer, sparse), backend=backend)
    return steps


def new_caches(config: HybridConfig, capacity: int, filled: int) -> dict[bool, HybridCache]:
    """{fp8: cache} holding `capacity` tokens, `filled` of them written (the same values in both)."""
    sized = dataclasses.replace(config, max_context=-(-capacity // config.block_size) * config.block_size)
    caches = {False: HybridCache(sized, 1, kv_dtype=torch.bfloat16),
              True: HybridCache(sized, 1, kv_dtype=FP8, index_dtype=torch.int8)}
    for cache in caches.values():
        cache.fill_synthetic_(filled, seed=1)
    return caches


def held_bytes(cache: HybridCache) -> int:
    """Bytes of the paged tensors a cache holds."""
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in dataclasses.astuple(layer) if isinstance(t, torch.Tensor))


@torch.no_grad()
def indexer_inputs(layer: ContextLayer, x: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(query `[1, 1, H, D]`, weights `[1, 1, H]`) the layer's indexer computes for the token `x` at `position`."""
    attn, indexer = layer.attn, layer.attn.indexer
    h = layer.attn_norm(x)
    qr = attn.q_norm(attn.q_a(h))
    cos, sin = indexer.rotary(torch.tensor([[position]]))
    q = indexer._rope_part(indexer.wq_b(qr).view(1, 1, indexer.n_heads, indexer.head_dim), cos, sin)
    weights = indexer.weights_proj(h) * indexer.n_heads ** -0.5 * indexer.softmax_scale
    return q, weights


@torch.no_grad()
def topk_overlaps(layer: ContextLayer, x: torch.Tensor, caches: dict[bool, HybridCache], context: int
                  ) -> dict[str, float]:
    """Share of the bf16 indexer's top-k keys (bf16 query and keys) that a quantized indexer also picks, for the token
    `x` after `context` cached ones: `topk_overlap`, the FP8 row's (per-token int8 query and the FP8 cache's stored
    int8 keys), and `topk_overlap_mxfp8`, MXFP8 query and keys (the bf16 cache's keys quantized to MXFP8)."""
    q, weights = indexer_inputs(layer, x, context)
    lengths = torch.tensor([context], dtype=torch.int32)
    plain, stored = caches[False], caches[True]
    ops = torch.ops.ascend_dsa

    def picks(query: torch.Tensor, keys: torch.Tensor, cache: HybridCache, query_scale: torch.Tensor | None = None,
              key_scale: torch.Tensor | None = None) -> set[int]:
        out = ops.lightning_indexer(query, keys, weights, None, lengths, cache.block_table, query_scale, key_scale,
                                    layout_key="PA_BSND", sparse_count=layer.config.index_topk, sparse_mode=3)
        return set(out[0].flatten().tolist()) - {-1}

    want = picks(q, plain.layers[0].index_k, plain)
    q8, q8_scale = ops.dynamic_block_quant(q.float(), block_size=q.shape[-1], dst_type=torch.int8)
    int8 = picks(q8, stored.layers[0].index_k, stored, q8_scale, stored.layers[0].index_k_scale)
    qmx, qmx_scale = ops.dynamic_mx_quant(q.float(), block_size=MX_GROUP)
    kmx, kmx_scale = ops.dynamic_mx_quant(plain.layers[0].index_k.float(), block_size=MX_GROUP)
    mxfp8 = picks(qmx, kmx, plain, qmx_scale, kmx_scale)
    share = len(want) or 1
    return {"topk_overlap": len(want & int8) / share, "topk_overlap_mxfp8": len(want & mxfp8) / share}

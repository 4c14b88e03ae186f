"""What `ascend-dsa bench context` times: one DeepSeek-V3.2-sized layer (npu_graph.models.context_layer) under each
row's execution, its caches at a given context, and the FP8 indexer's top-k overlap with the bf16 one.

Rows: dense MLA (`dense_*`, no indexer) and DSA (`dsa_*`) in eager and under Inductor, DSA under ascend_dsa
(`ascend_dsa`) and under ascend_dsa with the FP8 quant policy (`ascend_dsa_fp8`, quant="dsa": FP8 latent cache
with block-128 scales, FP8 RoPE key with one scale per token, MXFP8 indexer keys). Every compiled row calls the
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
            options = {"cache": False, **({"quant": "dsa"} if row in FP8_ROWS else {})}
            backend = npu_graph.Backend(npu_graph.CompilerConfig.from_options(options))
            steps[row] = torch.compile(_own_frame(layer, sparse), backend=backend)
    return steps


def new_caches(config: HybridConfig, capacity: int, filled: int) -> dict[bool, HybridCache]:
    """{fp8: cache} holding `capacity` tokens, `filled` of them written (the same values in both)."""
    sized = dataclasses.replace(config, max_context=-(-capacity // config.block_size) * config.block_size)
    caches = {fp8: HybridCache(sized, 1, kv_dtype=FP8 if fp8 else torch.bfloat16) for fp8 in (False, True)}
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
def topk_overlap(layer: ContextLayer, x: torch.Tensor, caches: dict[bool, HybridCache], context: int) -> float:
    """Share of the bf16 indexer's top-k keys (bf16 query and keys) that the MXFP8 indexer (quant="dsa": MXFP8
    query, the FP8 cache's MXFP8 keys) also picks, for the token `x` after `context` cached ones."""
    q, weights = indexer_inputs(layer, x, context)
    lengths = torch.tensor([context], dtype=torch.int32)
    picks = []
    for fp8, cache in caches.items():
        stored = cache.layers[0]
        common = {"actual_seq_lengths_key": lengths, "block_table": cache.block_table, "layout_key": "PA_BSND",
                  "sparse_count": layer.config.index_topk, "sparse_mode": 3}
        if fp8:
            codes, scale = torch.ops.ascend_dsa.dynamic_mx_quant(q.float(), block_size=MX_GROUP)
            out = torch.ops.ascend_dsa.lightning_indexer(
                codes, stored.index_k, weights, query_scale=scale,
                key_scale=stored.index_k_scale.view(torch.float8_e8m0fnu), **common)
        else:
            out = torch.ops.ascend_dsa.lightning_indexer(q, stored.index_k, weights, **common)
        picks.append(set(out[0].flatten().tolist()) - {-1})
    return len(picks[0] & picks[1]) / max(len(picks[0]), 1)

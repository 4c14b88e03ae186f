"""One decoder layer at DeepSeek-V3.2's attention dimensions, for measuring long-context cost.

`real_size_config(context)` holds DeepSeek-V3.2's attention sizes (hidden 7168, 128 heads, q_lora_rank 1536,
kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128, an indexer of 64 heads x 128 dims picking 2048 keys) with
the MoE replaced by one dense SwiGLU MLP of the shared expert's size (2048), so one layer's weights fit in memory,
and paged caches of block 128 that hold `context` tokens.

`ContextLayer.forward(x, cache, sparse)` runs the layer on hidden states `x` `[B, T, hidden]` and appends the T
tokens to `cache`: `sparse=True` is DSA (the lightning indexer's top-k rows only), `sparse=False` is dense MLA in
absorbed form, as serving engines run it: the same weights, no indexer, every cached latent row read (the
indexer's weights are then unused and its keys unwritten). Both forms share one set of weights.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from npu_graph.models.cache import HybridCache
from npu_graph.models.config import CONFIGS, HybridConfig
from npu_graph.models.dsa import DSAAttention, causal_visible
from npu_graph.models.moe import SwiGLU
from npu_graph.models.norm import RMSNorm

BLOCK_SIZE = 128
SHARED_EXPERT_SIZE = 2048       # DeepSeek-V3.2's moe_intermediate_size, one shared expert

REAL_SIZES = {"hidden_size": 7168, "num_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "index_n_heads": 64,
              "index_head_dim": 128, "index_rope_head_dim": 64, "index_topk": 2048,
              "intermediate_size": SHARED_EXPERT_SIZE}


def real_size_config(context: int, **sizes: int) -> HybridConfig:
    """A one-layer DSA config at DeepSeek-V3.2's attention sizes (overridden by `sizes`, for small tests) whose
    caches hold `context` tokens (rounded up to whole blocks)."""
    merged = {**REAL_SIZES, **sizes}
    block = merged.pop("block_size", BLOCK_SIZE)
    capacity = -(-context // block) * block
    return dataclasses.replace(CONFIGS["small"], num_layers=1, layer_types=["dsa"], first_k_dense_replace=1,
                               max_context=capacity, block_size=block, **merged)


class ContextLayer(nn.Module):
    """Pre-norm DSA (or dense MLA) attention and a dense SwiGLU MLP, with plain residual connections."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = DSAAttention(config, 0)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.hidden_size ** -0.5)

    def forward(self, x: torch.Tensor, cache: HybridCache, sparse: bool = True) -> torch.Tensor:
        positions = cache.positions(x.shape[1])
        h = self.attn_norm(x)
        mixed = self.attn(h, positions, cache) if sparse else dense_mla(self.attn, h, positions, cache)
        h = x + mixed
        out = h + self.mlp(self.mlp_norm(h))
        cache.advance_(x.shape[1])
        return out


def dense_mla(attn: DSAAttention, x: torch.Tensor, positions: torch.Tensor, cache: HybridCache) -> torch.Tensor:
    """MLA in absorbed form over every visible cached token: `attn`'s weights without its indexer."""
    layer = cache.layers[attn.layer_idx]
    _, q_latent, q_rope = attn.project(x, positions, cache, layer)
    latent = cache.read_all(layer.latent, dtype=q_latent.dtype, scale=layer.latent_scale)
    k_rope = cache.read_all(layer.k_rope, dtype=q_latent.dtype, scale=layer.k_rope_scale)
    scores = (torch.einsum("bthc,bsc->bhts", q_latent, latent)
              + torch.einsum("bthr,bsr->bhts", q_rope, k_rope)) * attn.softmax_scale
    hidden = ~causal_visible(positions, latent.shape[1]).unsqueeze(1)
    probs = F.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return attn.output(torch.einsum("bhts,bsc->bthc", probs, latent))


def bf16_context_layer(config: HybridConfig) -> ContextLayer:
    """A ContextLayer in bf16, its parameters made in bf16 from the start: at real size an fp32 copy would add
    1 GB to the process's peak memory before the cast."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return ContextLayer(config).eval().to(torch.bfloat16)
    finally:
        torch.set_default_dtype(default)


def weights_bytes(module: nn.Module) -> int:
    """Bytes of `module`'s parameters."""
    return sum(p.numel() * p.element_size() for p in module.parameters())

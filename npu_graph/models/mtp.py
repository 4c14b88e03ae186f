"""Multi-token prediction (MTP) in DeepSeek-V3's form: the draft head of speculative decoding.

For position i, the module reads the main model's last hidden state h_i and the embedding of the next token
x_{i+1}, normalises each with its own RMSNorm, concatenates them and projects back to the hidden size, runs one
decoder block (a DSA block with its own paged cache, `mtp_block_config`) and predicts token i+2 through its
norm and the main model's shared output head. Its output hidden state stands in for h when the module is applied
again to draft further tokens (k > 1 with one module, as serving stacks do).

The block's cache is a HybridCache of the one-layer block config (`HybridLM.new_mtp_cache`); rows past its length
are stale and masked like the main cache's, so a rejected draft is undone by resetting the length.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from npu_graph.models.attn_res import AttnRes
from npu_graph.models.cache import HybridCache
from npu_graph.models.norm import RMSNorm

if TYPE_CHECKING:
    from npu_graph.models.config import HybridConfig


def mtp_block_config(config: HybridConfig) -> HybridConfig:
    """The config of the MTP block and its cache: one DSA layer with a dense MLP, the main model's sizes."""
    return dataclasses.replace(config, num_layers=1, layer_types=["dsa"], first_k_dense_replace=1, mtp_layers=0)


class MTPModule(nn.Module):
    """One MTP depth: `forward(hidden, embeds, cache)` -> the block's output hidden state `[B, T, D]`."""

    def __init__(self, config: HybridConfig, block: nn.Module) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(dim, eps)
        self.hnorm = RMSNorm(dim, eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.final_res = AttnRes(dim, eps)
        self.norm = RMSNorm(dim, eps)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """Hidden states after the block for `hidden` (main model, positions i) and `embeds` (tokens i+1);
        appends the T positions to the block's `cache`."""
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        positions = cache.positions(x.shape[1])
        partial = self.block([x], None, positions, cache)
        cache.advance_(x.shape[1])
        return self.final_res([x, partial])

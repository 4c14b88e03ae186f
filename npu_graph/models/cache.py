"""Inference state of the hybrid model: a paged KV cache for DSA layers and recurrent state for KDA layers.

DSA layers keep three paged tensors, each `[num_blocks, block_size, 1, dim]` (one shared KV head, the layout of
`npu_sparse_flash_attention`'s `PA_BSND`): the MLA latent (kv_lora_rank), the rotated key part (qk_rope_head_dim)
and the lightning indexer's key (index_head_dim). A `block_table` `[B, max_blocks]` int32 maps a sequence's
logical block to a physical one; it is a shuffled permutation so that paging is real. `lengths` `[B]` int32 holds
the number of tokens already cached per sequence; the model reads the current position from it (never a Python
int), so one compiled decode graph serves every step.

All stores go through `write` (in place, `index_put_`) and all loads through `read_all` / `read_rows`, which
cast between the storage dtype `kv_dtype` and the compute dtype: a quantized cache changes only these three.

KDA layers keep the recurrent state `[B, H, K, V]` (fp32) and the short-convolution window
`[B, 3*H*K, conv_kernel-1]`, both updated in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from npu_graph.models.hybrid import HybridConfig


@dataclass
class DSALayerCache:
    """Paged storage of one DSA layer."""

    latent: torch.Tensor
    k_rope: torch.Tensor
    index_k: torch.Tensor


@dataclass
class KDALayerCache:
    """Recurrent state of one KDA layer."""

    state: torch.Tensor
    conv_state: torch.Tensor


class HybridCache:
    """Per-layer caches plus the shared block table and sequence lengths of a batch."""

    def __init__(self, config: HybridConfig, batch_size: int, kv_dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> None:
        self.config = config
        self.batch_size = batch_size
        self.kv_dtype = kv_dtype
        self.block_size = config.block_size
        self.max_blocks = config.max_context // config.block_size
        self.capacity = self.max_blocks * self.block_size
        num_blocks = batch_size * self.max_blocks
        generator = torch.Generator().manual_seed(seed)
        physical = torch.randperm(num_blocks, generator=generator)
        self.block_table = physical.view(batch_size, self.max_blocks).to(torch.int32)
        self.lengths = torch.zeros(batch_size, dtype=torch.int32)
        self.layers = [self._new_layer(kind, num_blocks) for kind in config.layer_types]

    def _new_layer(self, kind: str, num_blocks: int) -> DSALayerCache | KDALayerCache:
        cfg = self.config
        if kind == "dsa":
            def paged(dim: int) -> torch.Tensor:
                return torch.zeros(num_blocks, self.block_size, 1, dim, dtype=self.kv_dtype)
            return DSALayerCache(paged(cfg.kv_lora_rank), paged(cfg.qk_rope_head_dim), paged(cfg.index_head_dim))
        qkv = cfg.kda_num_heads * cfg.kda_head_dim
        state = torch.zeros(self.batch_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim)
        conv_state = torch.zeros(self.batch_size, 3 * qkv, cfg.kda_conv_kernel - 1)
        return KDALayerCache(state, conv_state)

    def positions(self, num_tokens: int) -> torch.Tensor:
        """Positions `[B, T]` (int64) of the next `num_tokens` tokens of every sequence."""
        offsets = torch.arange(num_tokens, device=self.lengths.device)
        return self.lengths.long().unsqueeze(1) + offsets

    def advance_(self, num_tokens: int) -> None:
        """Record that `num_tokens` more tokens of every sequence are now cached."""
        self.lengths.add_(num_tokens)

    def _slots(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Physical (block, offset) of logical positions `[B, N]`."""
        blocks = self.block_table.long().gather(1, positions // self.block_size)
        return blocks, positions % self.block_size

    def write(self, paged: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Store `values` `[B, T, 1, D]` at logical `positions` `[B, T]` of a paged tensor, in place."""
        blocks, offsets = self._slots(positions)
        paged.index_put_((blocks, offsets), values.to(paged.dtype))

    def read_all(self, paged: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole capacity `[B, capacity, D]` of a paged tensor in logical order (rows past a sequence's
        length hold stale data; callers mask them)."""
        rows = paged[self.block_table.long()]
        return rows.reshape(self.batch_size, self.capacity, paged.shape[-1]).to(dtype)

    def read_rows(self, paged: torch.Tensor, positions: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `[B, N, D]` at logical `positions` `[B, N]` of a paged tensor."""
        blocks, offsets = self._slots(positions)
        return paged[blocks, offsets].squeeze(-2).to(dtype)

    @torch.no_grad()
    def fill_synthetic_(self, length: int, seed: int = 0) -> None:
        """Pretend `length` tokens of every sequence were prefilled, with random cache contents.

        For benchmarks of decode at long context, where a real eager prefill would take minutes. Latent, rope
        and indexer rows are unit-variance (they come out of RMSNorm / LayerNorm in the model); KDA states are
        small.
        """
        generator = torch.Generator().manual_seed(seed)
        positions = torch.arange(length).expand(self.batch_size, length)
        for layer in self.layers:
            if isinstance(layer, DSALayerCache):
                for paged in (layer.latent, layer.k_rope, layer.index_k):
                    rows = torch.randn(self.batch_size, length, 1, paged.shape[-1], generator=generator)
                    self.write(paged, positions, rows)
            else:
                layer.state.copy_(0.1 * torch.randn(layer.state.shape, generator=generator))
                layer.conv_state.copy_(torch.randn(layer.conv_state.shape, generator=generator))
        self.lengths.fill_(length)

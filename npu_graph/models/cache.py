"""Inference state of the hybrid model: a paged KV cache for DSA layers and recurrent state for KDA layers.

DSA layers keep three paged tensors, each `[num_blocks, block_size, 1, dim]` (one shared KV head, the layout of
`npu_sparse_flash_attention`'s `PA_BSND`): the MLA latent (kv_lora_rank), the rotated key part (qk_rope_head_dim)
and the lightning indexer's key (index_head_dim). A `block_table` `[B, max_blocks]` int32 maps a sequence's
logical block to a physical one; it is a shuffled permutation so that paging is real. The paged tensors live in
2 MiB pages where the system has them (kernels/huge_pages.py): a decode step gathers their rows at random.
`lengths` `[B]` int32 holds the number of tokens already cached per sequence; the model reads the current
position from it (never a Python int), so one compiled decode graph serves every step.

All stores go through `write` (in place, `index_put_`) and all loads through `read_all` / `read_rows`, which
cast between the storage dtype `kv_dtype` and the compute dtype: a quantized cache changes only these three.

`kv_dtype=torch.float8_e4m3fn` stores the latent as FP8 with one fp32 scale per token and 128 values
(`ascend_dsa.dynamic_block_quant`, in `latent_scale`) and the indexer key as MXFP8 with one E8M0 scale per 32
values (`ascend_dsa.dynamic_mx_quant`; the scale bytes are kept as uint8 in `index_k_scale`, since index_put_
has no E8M0 kernel), as DeepSeek-V3.2 does, and the RoPE key as FP8 too, with one fp32 scale per token over its
qk_rope_head_dim values (`k_rope_scale`), where DeepSeek-V3.2 keeps it in bf16: 64 + 4 bytes instead of 128, which
brings a token of its sizes to 728 bytes against bf16's 1408 (0.52x; a bf16 RoPE key leaves 788, 0.56x). Its
error is e4m3's, as the latent's (relative 2^-4 a value at most), on a part of the logits only. Writes quantize;
reads dequantize the whole paged tensor and then gather, so a fused op can be handed the stored codes instead.
`index_dtype=torch.int8` stores the indexer key as per-token int8 instead, with one fp32 scale per token
(`ascend_dsa.dynamic_block_quant` with dst_type=int8, in `index_k_scale`): the same bytes as MXFP8 (D + 4), the form
Ascend's quantized lightning indexer reads on Atlas A2/A3 (quant.indexer="int8"); it goes with any kv_dtype.

KDA layers keep the recurrent state `[B, H, K, V]` (fp32) and the short-convolution window
`[B, 3*H*K, conv_kernel-1]`, both updated in place; with `slots` (kda_slots.py, set by a speculative decode loop)
a multi-token forward also keeps what rolling them back needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from npu_graph.kernels import huge_pages
from npu_graph.models.kda_slots import KDALayerCache

FP8 = torch.float8_e4m3fn
KV_TILE = 128
MX_GROUP = 32
SYNTHETIC_CHUNK = 1024    # tokens of synthetic cache rows made at a time: bounds their fp32 working memory

if TYPE_CHECKING:
    from npu_graph.models.config import HybridConfig


@dataclass
class DSALayerCache:
    """Paged storage of one DSA layer."""

    latent: torch.Tensor
    k_rope: torch.Tensor
    index_k: torch.Tensor
    latent_scale: torch.Tensor | None = None
    index_k_scale: torch.Tensor | None = None
    k_rope_scale: torch.Tensor | None = None


class HybridCache:
    """Per-layer caches plus the shared block table and sequence lengths of a batch."""

    def __init__(self, config: HybridConfig, batch_size: int, kv_dtype: torch.dtype = torch.float32,
                 seed: int = 0, index_dtype: torch.dtype | None = None) -> None:
        if index_dtype not in (None, FP8, torch.int8, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"HybridCache: index_dtype {index_dtype} is not one the indexer reads; use None (as "
                             f"kv_dtype), torch.int8 (per-token int8), torch.float8_e4m3fn (MXFP8) or a float dtype")
        self.config = config
        self.batch_size = batch_size
        self.kv_dtype = kv_dtype
        self.index_dtype = kv_dtype if index_dtype is None else index_dtype
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
            return self._new_dsa_layer(num_blocks)
        qkv = cfg.kda_num_heads * cfg.kda_head_dim
        state = torch.zeros(self.batch_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim)
        conv_state = torch.zeros(self.batch_size, 3 * qkv, cfg.kda_conv_kernel - 1)
        return KDALayerCache(state, conv_state)

    def _new_dsa_layer(self, num_blocks: int) -> DSALayerCache:
        cfg = self.config

        def paged(dim: int, dtype: torch.dtype) -> torch.Tensor:      # rows a decode step gathers at random
            return huge_pages.zeros(num_blocks, self.block_size, 1, dim, dtype=dtype)

        if self.kv_dtype == FP8 and cfg.kv_lora_rank % KV_TILE:
            raise ValueError(f"HybridCache: an FP8 cache needs kv_lora_rank a multiple of {KV_TILE}; got "
                             f"{cfg.kv_lora_rank}. Use kv_dtype=torch.bfloat16 or float32 for this config")
        if self.index_dtype == FP8 and cfg.index_head_dim % MX_GROUP:
            raise ValueError(f"HybridCache: MXFP8 indexer keys need index_head_dim a multiple of {MX_GROUP}; got "
                             f"{cfg.index_head_dim}. Use kv_dtype=torch.bfloat16 or float32, or index_dtype=torch.int8")
        layer = DSALayerCache(*(paged(d, self.kv_dtype) for d in (cfg.kv_lora_rank, cfg.qk_rope_head_dim)),
                              paged(cfg.index_head_dim, self.index_dtype))
        if self.kv_dtype == FP8:
            layer.latent_scale = paged(cfg.kv_lora_rank // KV_TILE, torch.float32)
            layer.k_rope_scale = paged(1, torch.float32)
        if self.index_dtype in (FP8, torch.int8):
            layer.index_k_scale = paged(cfg.index_head_dim // MX_GROUP, torch.uint8) if self.index_dtype == FP8 \
                else paged(1, torch.float32)
        return layer

    def bytes_per_token(self) -> dict[str, int]:
        """Stored bytes per token and DSA layer: the latent KV (with its scales), RoPE key and indexer key."""
        layer = next((x for x in self.layers if isinstance(x, DSALayerCache)), None)
        if layer is None:
            return {}

        def row(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.shape[-1] * t.element_size()

        return {"latent": row(layer.latent) + row(layer.latent_scale),
                "k_rope": row(layer.k_rope) + row(layer.k_rope_scale),
                "index_k": row(layer.index_k) + row(layer.index_k_scale)}

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

    def write(self, paged: torch.Tensor, positions: torch.Tensor, values: torch.Tensor,
              scale: torch.Tensor | None = None) -> None:
        """Store `values` `[B, T, 1, D]` at logical `positions` `[B, T]` of a paged tensor, in place; with
        `scale` (a quantized tensor's scales), quantize first and store the scales too."""
        blocks, offsets = self._slots(positions)
        if scale is not None:
            values, scales = _quantize(values, scale, paged.dtype)
            scale.index_put_((blocks, offsets), scales)
        paged.index_put_((blocks, offsets), values.to(paged.dtype))

    def read_all(self, paged: torch.Tensor, dtype: torch.dtype = torch.float32,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
        """The whole capacity `[B, capacity, D]` of a paged tensor in logical order (rows past a sequence's
        length hold stale data; callers mask them)."""
        rows = _dequantize(paged, scale)[self.block_table.long()]
        return rows.reshape(self.batch_size, self.capacity, paged.shape[-1]).to(dtype)

    def read_rows(self, paged: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype = torch.float32,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `[B, N, D]` at logical `positions` `[B, N]` of a paged tensor."""
        blocks, offsets = self._slots(positions)
        return _dequantize(paged, scale)[blocks, offsets].squeeze(-2).to(dtype)

    @torch.no_grad()
    def fill_synthetic_(self, length: int, seed: int = 0) -> None:
        """Pretend `length` tokens of every sequence were prefilled, with random cache contents.

        For benchmarks of decode at long context, where a real eager prefill would take minutes. Latent, rope
        and indexer rows are unit-variance (they come out of RMSNorm / LayerNorm in the model); KDA states are
        small.
        """
        generator = torch.Generator().manual_seed(seed)
        for layer in self.layers:
            if isinstance(layer, DSALayerCache):
                for paged, scale in ((layer.latent, layer.latent_scale), (layer.k_rope, layer.k_rope_scale),
                                     (layer.index_k, layer.index_k_scale)):
                    for start in range(0, length, SYNTHETIC_CHUNK):     # fp32 rows of a chunk at a time
                        stop = min(start + SYNTHETIC_CHUNK, length)
                        positions = torch.arange(start, stop).expand(self.batch_size, stop - start)
                        rows = torch.randn(self.batch_size, stop - start, 1, paged.shape[-1], generator=generator)
                        self.write(paged, positions, rows, scale)
            else:
                layer.state.copy_(0.1 * torch.randn(layer.state.shape, generator=generator))
                layer.conv_state.copy_(torch.randn(layer.conv_state.shape, generator=generator))
        self.lengths.fill_(length)


def _quantize(values: torch.Tensor, scale: torch.Tensor, codes: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of `values` in the format of the stored `scale` and `codes`: fp32 scales -> FP8 or int8 with one
    scale per tile (128 values of the latent, the whole RoPE key or int8 indexer key), uint8 -> MXFP8."""
    if scale.dtype == torch.float32:
        return torch.ops.ascend_dsa.dynamic_block_quant(values.float(), block_size=_tile(values, scale),
                                                        dst_type=codes)
    codes, exponents = torch.ops.ascend_dsa.dynamic_mx_quant(values.float(), block_size=MX_GROUP)
    return codes, exponents.view(torch.uint8)


def _dequantize(paged: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 values of a stored quantized paged tensor (the tensor itself when it is not quantized)."""
    if scale is None:
        return paged
    if scale.dtype == torch.float32:
        return torch.ops.ascend_dsa.dequant_block(paged, scale, block_size=_tile(paged, scale))
    return torch.ops.ascend_dsa.dequant_mx(paged, scale.view(torch.float8_e8m0fnu), block_size=MX_GROUP)


def _tile(values: torch.Tensor, scale: torch.Tensor) -> int:
    """Values per fp32 scale of a block-quantized paged tensor."""
    return values.shape[-1] // scale.shape[-1]

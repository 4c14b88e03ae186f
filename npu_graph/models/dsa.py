"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): MLA in absorbed form + lightning indexer + top-k attention.

MLA: q = q_b(q_norm(q_a(x))) split into a no-position part and a RoPE part; the per-token KV latent is
kv_norm(kv_a(x))[..., :kv_lora_rank] plus one shared RoPE key. Attention runs in the latent space (absorbed
form): q_nope is multiplied by kv_b's key weights, logits = q_latent.c_kv + q_rope.k_rope, the output is the
probability-weighted latent multiplied by kv_b's value weights, then o_proj.

Lightning indexer: score[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s]) over index heads j, causal, and the
top `index_topk` keys per query are the only ones attention may use. Prefill scatters 0 at the selected keys
into a -inf mask over dense attention (as transformers does); a step of up to GATHER_MAX_TOKENS new tokens (decode,
a speculative verify step) gathers only each token's selected latent rows from the paged cache. Keys past a
query's position are masked in both, even when top-k picked them because fewer keys were visible than
`index_topk`.

Keys are read over the cache's whole static capacity and masked by position, so shapes never depend on the
current length.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from npu_graph.models.cache import DSALayerCache, HybridCache
from npu_graph.models.norm import RMSNorm

if TYPE_CHECKING:
    from npu_graph.models.config import HybridConfig

# Steps of at most this many new tokens (decode, a speculative verify step) gather each token's selected rows;
# longer ones (prefill) run dense attention under the selection's mask, as DeepSeek's reference does.
GATHER_MAX_TOKENS = 16


class Rotary(nn.Module):
    """RoPE angles for integer positions: `forward(positions [B, T])` -> (cos, sin), each `[B, T, dim/2]`."""

    def __init__(self, dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.unsqueeze(-1).float() * self.inv_freq
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate `x` `[B, T, H, D]` by per-position angles `[B, T, D/2]`.

    Interleaved pairs (x0, x1), (x2, x3)... for MLA, as DeepSeek's reference; halves (x[:D/2], x[D/2:]) for the
    indexer. The angles are fp32, so a bf16 `x` is rotated in fp32 (as DeepSeek's reference does); the layers cast
    the result back to `x`'s dtype.
    """
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def causal_visible(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Bool `[B, T, S]`: key s is visible to the query at `positions[b, t]` iff s <= that position."""
    keys = torch.arange(num_keys, device=positions.device)
    return keys <= positions.unsqueeze(-1)


def indexer_kl_loss(index_scores: torch.Tensor, attention_logits: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ softmax(index_scores)) averaged over queries, p being the dense attention distribution summed over
    heads and renormalised (DeepSeek-V3.2's indexer warm-up objective): index_scores `[B, T, S]`,
    attention_logits `[B, H, T, S]` (causal mask included, detached). Keys no query sees (-inf in both) add 0."""
    target = F.softmax(attention_logits, dim=-1).sum(dim=1)
    target = target / target.sum(dim=-1, keepdim=True)
    log_q = F.log_softmax(index_scores, dim=-1)
    log_q = torch.where(target > 0, log_q, torch.zeros_like(log_q))
    per_query = (torch.xlogy(target, target) - target * log_q).sum(dim=-1)
    return per_query.mean()


class LightningIndexer(nn.Module):
    """DSA's lightning indexer: picks the `index_topk` most relevant visible keys for every query."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.index_rope_head_dim
        self.topk = config.index_topk
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.softmax_scale = self.head_dim ** -0.5
        self.rotary = Rotary(self.rope_dim, config.rope_theta)

    def _rope_part(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x_pe, x_nope = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rope(x_pe, cos, sin, interleaved=False).to(x.dtype), x_nope), dim=-1)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, cache: HybridCache,
                layer: DSALayerCache) -> torch.Tensor:
        """Top-k key positions `[B, T, min(index_topk, capacity)]` (int64) per query; writes this step's keys.

        In training mode the indexer reads detached inputs (only its KL loss trains it, as DeepSeek-V3.2's
        indexer is trained) and keeps its masked scores in `self.scores` for DSAAttention's loss."""
        if self.training:
            x, qr = x.detach(), qr.detach()
        batch, seq, _ = x.shape
        cos, sin = self.rotary(positions)
        q = self._rope_part(self.wq_b(qr).view(batch, seq, self.n_heads, self.head_dim), cos, sin)
        k = self._rope_part(self.k_norm(self.wk(x)).unsqueeze(2), cos, sin)
        cache.write(layer.index_k, positions, k, layer.index_k_scale)
        keys = cache.read_all(layer.index_k, dtype=q.dtype, scale=layer.index_k_scale)
        weights = self.weights_proj(x) * self.n_heads ** -0.5 * self.softmax_scale
        scores = torch.einsum("bthd,bsd->bths", q, keys).relu()
        index_scores = (scores * weights.unsqueeze(-1)).sum(dim=2)
        index_scores = index_scores.masked_fill(~causal_visible(positions, keys.shape[1]), float("-inf"))
        if self.training:
            self.scores = index_scores
        return index_scores.topk(min(self.topk, keys.shape[1]), dim=-1).indices


class DSAAttention(nn.Module):
    """MLA with the lightning indexer's top-k sparsity; reads and writes the layer's paged cache."""

    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_heads
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.q_a = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b = nn.Linear(config.q_lora_rank, self.n_heads * (self.nope_dim + self.rope_dim), bias=False)
        self.kv_a = nn.Linear(config.hidden_size, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b = nn.Linear(self.kv_lora_rank, self.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, config.hidden_size, bias=False)
        self.softmax_scale = (self.nope_dim + self.rope_dim) ** -0.5
        self.rotary = Rotary(self.rope_dim, config.rope_theta)
        self.indexer = LightningIndexer(config)

    def project(self, x: torch.Tensor, positions: torch.Tensor, cache: HybridCache, layer: DSALayerCache
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qr, q_latent `[B, T, H, C]`, rotated q_rope `[B, T, H, R]`) of `x`; writes this step's latent and
        RoPE key to the cache."""
        batch, seq, _ = x.shape
        cos, sin = self.rotary(positions)
        qr = self.q_norm(self.q_a(x))
        q = self.q_b(qr).view(batch, seq, self.n_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin, interleaved=True).to(x.dtype)
        latent, k_rope = self.kv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_norm(latent)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin, interleaved=True).to(x.dtype)
        cache.write(layer.latent, positions, latent.unsqueeze(2), layer.latent_scale)
        cache.write(layer.k_rope, positions, k_rope, layer.k_rope_scale)
        w_uk = self._absorbed_weights()[0]
        return qr, torch.einsum("bthd,hdc->bthc", q_nope, w_uk), q_rope

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b's key and value weights per head, `[H, nope, C]` and `[H, v, C]`."""
        w_kv = self.kv_b.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w_kv.split([self.nope_dim, self.v_dim], dim=1)

    def output(self, out_latent: torch.Tensor) -> torch.Tensor:
        """o_proj of the value-projected attention output `out_latent` `[B, T, H, C]`."""
        batch, seq = out_latent.shape[:2]
        w_uv = self._absorbed_weights()[1]
        out = torch.einsum("bthc,hvc->bthv", out_latent, w_uv)
        return self.o_proj(out.reshape(batch, seq, self.n_heads * self.v_dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        layer = cache.layers[self.layer_idx]
        qr, q_latent, q_rope = self.project(x, positions, cache, layer)
        topk = self.indexer(x, qr, positions, cache, layer)
        if x.shape[1] <= GATHER_MAX_TOKENS and not self.training:
            out_latent = self._gathered(q_latent, q_rope, topk, positions, cache, layer)
        else:
            out_latent = self._prefill(q_latent, q_rope, topk, positions, cache, layer)
        return self.output(out_latent)

    def _prefill(self, q_latent: torch.Tensor, q_rope: torch.Tensor, topk: torch.Tensor,
                 positions: torch.Tensor, cache: HybridCache, layer: DSALayerCache) -> torch.Tensor:
        """Dense attention over the whole cache under the indexer's sparse mask; returns `[B, T, H, C]`."""
        latent = cache.read_all(layer.latent, dtype=q_latent.dtype, scale=layer.latent_scale)
        k_rope = cache.read_all(layer.k_rope, dtype=q_latent.dtype, scale=layer.k_rope_scale)
        scores = (torch.einsum("bthc,bsc->bhts", q_latent, latent)
                  + torch.einsum("bthr,bsr->bhts", q_rope, k_rope)) * self.softmax_scale
        batch, seq, num_keys = topk.shape[0], topk.shape[1], latent.shape[1]
        index_mask = scores.new_full((batch, seq, num_keys), float("-inf"))
        index_mask = index_mask.scatter(-1, topk, 0.0)
        causal_mask = torch.zeros_like(index_mask).masked_fill(~causal_visible(positions, num_keys), float("-inf"))
        if self.training:
            self.aux_loss = indexer_kl_loss(self.indexer.scores, scores.detach() + causal_mask.unsqueeze(1))
        probs = F.softmax(scores + (index_mask + causal_mask).unsqueeze(1), dim=-1)
        return torch.einsum("bhts,bsc->bthc", probs, latent)

    def _gathered(self, q_latent: torch.Tensor, q_rope: torch.Tensor, topk: torch.Tensor,
                  positions: torch.Tensor, cache: HybridCache, layer: DSALayerCache) -> torch.Tensor:
        """Attention of each new token over only its selected latent rows; returns `[B, T, H, C]`.

        Every mask is as wide as the selection, never as the cache: key p is visible to the token at position
        `positions[b, t]` iff p <= that position (each token is its own decode row)."""
        batch, seq, count = topk.shape
        selected = topk.reshape(batch, seq * count)      # the sequence's own blocks hold all its tokens' rows
        latent = cache.read_rows(layer.latent, selected, dtype=q_latent.dtype, scale=layer.latent_scale)
        k_rope = cache.read_rows(layer.k_rope, selected, dtype=q_latent.dtype, scale=layer.k_rope_scale)
        latent, k_rope = latent.view(batch, seq, count, -1), k_rope.view(batch, seq, count, -1)
        scores = (torch.einsum("bthc,btkc->bthk", q_latent, latent)
                  + torch.einsum("bthr,btkr->bthk", q_rope, k_rope)) * self.softmax_scale
        visible = selected.view(batch, seq, count) <= positions.unsqueeze(-1)
        scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))
        probs = F.softmax(scores, dim=-1)
        return torch.einsum("bthk,btkc->bthc", probs, latent)

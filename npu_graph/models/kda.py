"""Kimi Delta Attention (KDA, Kimi Linear): gated delta-rule linear attention with per-channel decay.

Per head, with state S [K, V]:  S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,
o_t = S_t^T q_t * scale. The layer: q/k/v projections, causal depthwise short convolution + SiLU, L2-normalised
q and k, per-channel log-decay g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias), beta = sigmoid(b_proj(x)),
the core `kda_core`, then a sigmoid-gated RMSNorm and o_proj.

`kda_core` is the only place the core is computed: for several tokens it calls the chunked kernel
`torch.ops.ascend_dsa.chunk_kda` (as real models call fla's `chunk_kda`), for a single token one recurrent step.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from npu_graph.models.cache import HybridCache, KDALayerCache
from npu_graph.models.norm import GatedRMSNorm

if TYPE_CHECKING:
    from npu_graph.models.config import HybridConfig


def kda_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             scale: float, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
             chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA core. q, k, g `[B, T, H, K]` (g: log-decay <= 0), v `[B, T, H, V]`, beta `[B, T, H]`,
    initial_state `[B, H, K, V]` or None (zeros). Returns (o `[B, T, H, V]` in v's dtype, final state fp32 or None).
    """
    batch, _, heads, dim_k = k.shape
    state = initial_state
    if state is None:
        state = torch.zeros(batch, heads, dim_k, v.shape[-1], dtype=torch.float32, device=v.device)
    if q.shape[1] == 1:
        o, state = _kda_step(q, k, v, g, beta, scale, state.float())
    else:
        o, state = torch.ops.ascend_dsa.chunk_kda(q, k, v, g, beta, scale, state.float(), output_final_state=True,
                                                  chunk_size=chunk_size)
    return o.to(v.dtype), (state if output_final_state else None)


def _kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step (T == 1)."""
    q, k, v, g, beta = (t[:, 0].float() for t in (q, k, v, g, beta))
    state = state * g.exp().unsqueeze(-1)
    delta = beta.unsqueeze(-1) * (v - torch.einsum("bhk,bhkv->bhv", k, state))
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    o = torch.einsum("bhk,bhkv->bhv", q * scale, state)
    return o.unsqueeze(1), state


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (fla's l2norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class KimiDeltaAttention(nn.Module):
    """The KDA token mixer; keeps its recurrent and short-convolution state in the cache."""

    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.kda_num_heads
        self.head_dim = config.kda_head_dim
        qkv = self.n_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, qkv, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, qkv, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, qkv, bias=False)
        self.conv = nn.Conv1d(3 * qkv, 3 * qkv, config.kda_conv_kernel, groups=3 * qkv, bias=False)
        self.f_a = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.f_b = nn.Linear(self.head_dim, qkv, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.n_heads).uniform_(1, 16).log())
        self.dt_bias = nn.Parameter(_inverse_softplus_dt(qkv))
        self.b_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.g_a = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.g_b = nn.Linear(self.head_dim, qkv, bias=False)
        self.o_norm = GatedRMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = nn.Linear(qkv, config.hidden_size, bias=False)

    def short_conv(self, x: torch.Tensor, layer: KDALayerCache) -> torch.Tensor:
        """Causal depthwise convolution + SiLU over `[B, C, T]`, continuing from (and updating) the cached window."""
        window = torch.cat((layer.conv_state, x), dim=-1)
        layer.conv_state.copy_(window[..., -layer.conv_state.shape[-1]:])
        return F.silu(F.conv1d(window, self.conv.weight, groups=window.shape[1]))

    def forward(self, x: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        batch, seq, _ = x.shape
        layer = cache.layers[self.layer_idx]
        heads = (batch, seq, self.n_heads, self.head_dim)
        mixed = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1).transpose(1, 2)
        if layer.slots is not None:
            layer.slots.record_inputs(layer, mixed)
        q, k, v = self.short_conv(mixed, layer).transpose(1, 2).chunk(3, dim=-1)
        q, k, v = l2_normalize(q.reshape(heads)), l2_normalize(k.reshape(heads)), v.reshape(heads)
        forget = self.f_b(self.f_a(x)).view(heads) + self.dt_bias.view(self.n_heads, self.head_dim)
        g = -self.A_log.exp().unsqueeze(-1) * F.softplus(forget)
        beta = torch.sigmoid(self.b_proj(x))
        # training: autograd keeps the entering state, which the copy_ below would overwrite
        entering = layer.state.clone() if self.training else layer.state
        if layer.slots is not None:
            o, state = layer.slots.core_(q, k, v, g, beta, self.head_dim ** -0.5, entering)
        else:
            o, state = kda_core(q, k, v, g, beta, scale=self.head_dim ** -0.5, initial_state=entering,
                                output_final_state=True)
        layer.state.copy_(state)
        o = self.o_norm(o, self.g_b(self.g_a(x)).view(heads))
        return self.o_proj(o.reshape(batch, seq, -1))


def _inverse_softplus_dt(size: int, dt_min: float = 1e-3, dt_max: float = 0.1) -> torch.Tensor:
    """dt_bias such that softplus(dt_bias) is log-uniform in [dt_min, dt_max] (Mamba / fla initialisation)."""
    dt = torch.empty(size).uniform_(math.log(dt_min), math.log(dt_max)).exp()
    return dt + torch.log(-torch.expm1(-dt))

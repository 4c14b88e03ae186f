"""DeepSeek-V3 mixture of experts: group-limited sigmoid routing, SwiGLU experts and a shared expert.

Routing (`MoEGate`): scores = sigmoid(x W^T); `e_score_correction_bias` is added for *selection only*; experts
are split into `n_group` groups, a group scores the sum of its two best experts, only the best `topk_group`
groups stay eligible, the top `num_experts_per_tok` eligible experts are chosen, and their (unbiased) scores are
normalised to sum to one and multiplied by `routed_scaling_factor`.

The routed experts run in a per-expert loop, as model authors write it; each expert is applied to every token
and weighted by that token's routing weight for it (zero when not selected), so shapes never depend on routing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from npu_graph.models.config import HybridConfig


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense MLP, each routed expert and the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def balance_loss(scores: torch.Tensor, topk_ids: torch.Tensor, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's complementary balance loss over the tokens of a batch: Σ_i f_i P_i, with f_i the fraction of
    routed slots expert i received times n_experts / top_k (1 when balanced) and P_i its mean normalised
    affinity. It is 1 for a perfectly balanced router and grows as routing collapses onto few experts."""
    n_tokens, n_experts = scores.shape
    counts = torch.zeros(n_experts, device=scores.device).index_add_(
        0, topk_ids.flatten(), torch.ones(topk_ids.numel(), device=scores.device))
    fraction = counts * n_experts / (top_k * n_tokens)
    affinity = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=0)
    return (fraction * affinity).sum()


class MoEGate(nn.Module):
    """DeepSeek-V3 router: `forward(x [N, D])` -> (topk_weights fp32 `[N, k]`, topk_ids int64 `[N, k]`)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.n_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.n_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        grouped = choice.view(-1, self.n_group, self.n_experts // self.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(self.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1.0).bool()
        choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).flatten(1)
        topk_ids = choice.topk(self.top_k, dim=-1).indices
        topk_weights = scores.gather(1, topk_ids)
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.training:
            self.aux_loss = balance_loss(scores, topk_ids, self.top_k)
        return topk_weights * self.routed_scaling_factor, topk_ids


class DeepSeekMoE(nn.Module):
    """Routed SwiGLU experts plus always-on shared experts."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.gate = MoEGate(config)
        self.experts = nn.ModuleList(
            SwiGLU(config.hidden_size, config.moe_intermediate_size) for _ in range(config.n_routed_experts))
        self.shared_experts = SwiGLU(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        topk_weights, topk_ids = self.gate(tokens)
        routed = torch.zeros_like(tokens)
        for expert_id, expert in enumerate(self.experts):
            weight = (topk_weights * (topk_ids == expert_id)).sum(dim=-1, keepdim=True)
            routed = routed + expert(tokens) * weight.to(tokens.dtype)
        return (routed + self.shared_experts(tokens)).view_as(x)

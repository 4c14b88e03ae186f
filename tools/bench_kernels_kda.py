"""Benchmark cases for the Kimi linear attention (KDA), attention residual and MoE kernels, for
`ascend-dsa bench kernels`.

Each case times, side by side, the ascend_dsa op against the slow form it replaces:
  - chunk_kda prefill (T=4096, 4 heads, K=V=128, fp32) against the step-by-step recurrence
    (`reference_chunk_kda`) and against transformers' CPU fallback `chunk_kimi_delta_attention`;
  - fused_moe against transformers' eager expert loop (KimiLinearExperts.forward), at decode and prefill;
    both are bound by the expert GEMMs (prefill) or by reading the expert weights (decode), so the
    targets ask for parity; the gain is one graph node that maps to the NPU's grouped-matmul MoE;
  - attn_res against the naive form (stack, RMSNorm, softmax over depth, weighted sum);
  - moe_gating_top_k against transformers' DeepSeek-V3 / Kimi grouped router.
A case may carry "repeat": the number of timed rounds its slow candidates are worth (the step recurrence
takes seconds per call).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from npu_graph.kernels import attn_res  # noqa: F401  (registers the ops)
from npu_graph.kernels.attn_res import reference_attn_res
from npu_graph.kernels.kda.chunk_kda import reference_chunk_kda

OPS = torch.ops.ascend_dsa


def _case(name: str, baseline: str, slow: Callable[[], object], ours: Callable[[], object], target: float,
          **extra: Any) -> dict[str, Any]:
    return {"name": name, "candidates": {baseline: slow, "ascend_dsa": ours}, "baseline": baseline,
            "ours": "ascend_dsa", "targets": {f"speedup_vs_{baseline}": target}, **extra}


def _kda_cases(g: torch.Generator) -> list[dict[str, Any]]:
    b, t, h, d = 1, 4096, 4, 128
    q = torch.randn(b, t, h, d, generator=g)
    k = F.normalize(torch.randn(b, t, h, d, generator=g), dim=-1)
    v = torch.randn(b, t, h, d, generator=g)
    gate = -torch.rand(b, t, h, d, generator=g) * 0.1
    beta = torch.rand(b, t, h, generator=g)
    kimi = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")  # after npu_graph
    fallback = getattr(kimi.chunk_kimi_delta_attention, "__wrapped__", kimi.chunk_kimi_delta_attention)
    ours = lambda: OPS.chunk_kda(q, k, v, gate, beta, output_final_state=True)  # noqa: E731
    name = "chunk_kda prefill T=4096 H=4 K=V=128 fp32"
    return [_case(name, "step_recurrence", lambda: reference_chunk_kda(q, k, v, gate, beta), ours, 20.0, repeat=3),
            _case(name, "transformers_fallback", lambda: fallback(q, k, v, gate, beta, output_final_state=True),
                  ours, 10.0, repeat=3)]


def expert_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """transformers' eager KimiLinearExperts.forward, w13 standing for gate_up_proj and w2 for down_proj."""
    out = torch.zeros_like(x)
    mask = F.one_hot(ids.long(), num_classes=w13.shape[0]).permute(2, 1, 0)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        slot, token = torch.where(mask[e[0]])
        gate, up = F.linear(x[token], w13[e[0]]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e[0]]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def _moe_cases(g: torch.Generator) -> list[dict[str, Any]]:
    hidden, inter, experts, top_k = 1024, 512, 64, 6
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    cases = []
    for tokens, dtype, target in ((4, torch.bfloat16, 1.0), (4, torch.float32, 0.9), (1024, torch.bfloat16, 1.0),
                                  (1024, torch.float32, 0.9)):
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        ids = torch.argsort(torch.rand(tokens, experts, generator=g), dim=-1)[:, :top_k]
        weights = torch.rand(tokens, top_k, generator=g)
        args = (x, w13.to(dtype), w2.to(dtype), weights, ids.int())
        cases.append(_case(f"fused_moe T={tokens} E={experts} k={top_k} H={hidden} I={inter} {str(dtype)[6:]}",
                           "expert_loop", lambda a=args: expert_loop(*a), lambda a=args: OPS.fused_moe(*a), target))
    return cases


def _attn_res_cases(g: torch.Generator) -> list[dict[str, Any]]:
    n, t, d, s = 8, 2048, 1024, 4
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        blocks = torch.randn(n, 1, t, d, generator=g).to(dtype)
        partial = torch.randn(1, t, d, generator=g).to(dtype)
        queries = torch.randn(s, d, generator=g).to(dtype)
        weight = (torch.rand(d, generator=g) + 0.5).to(dtype)
        args = (blocks, partial, queries, weight)
        cases.append(_case(f"attn_res N={n} T={t} D={d} S={s} {str(dtype)[6:]}", "naive",
                           lambda a=args: reference_attn_res(*a), lambda a=args: OPS.attn_res(*a), 1.5))
    return cases


def grouped_router(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                   scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' KimiLinearTopkRouter / DeepSeek-V3 routing after the router GEMM."""
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, n_group, logits.shape[1] // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, logits.shape[1] // n_group).reshape(logits.shape)
    idx = torch.topk(choice.masked_fill(~score_mask.bool(), float("-inf")), k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, idx)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling, idx


def _gating_cases(g: torch.Generator) -> list[dict[str, Any]]:
    logits = torch.randn(4096, 256, generator=g)
    bias = torch.randn(256, generator=g) * 0.1
    ours = lambda: OPS.moe_gating_top_k(logits, 8, bias, k_group=4, group_count=8,  # noqa: E731
                                        group_select_mode=1, routed_scaling_factor=2.5)
    return [_case("moe_gating_top_k T=4096 E=256 groups 4/8 k=8", "transformers_router",
                  lambda: grouped_router(logits, bias, 8, 8, 4, 2.5), ours, 1.1)]


def cases() -> list[dict[str, Any]]:
    """The benchmark cases of this file: {name, candidates, baseline, ours, targets[, repeat]} each."""
    g = torch.Generator().manual_seed(0)
    return _kda_cases(g) + _moe_cases(g) + _attn_res_cases(g) + _gating_cases(g)

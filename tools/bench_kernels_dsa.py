"""Benchmark cases for the DSA operators (`ascend-dsa bench kernels`): the lightning indexer and sparse flash
attention in a DeepSeek-V3.2 decode step, each against the eager formulation it replaces.

`cases()` returns one dict per case: {"name", "candidates": {label: zero-argument callable}, "baseline": label
of the eager formulation, "ours": label of the fused op, "targets": {...}}. Targets: "speedup_vs_eager" is
the least baseline/ours time ratio; "time_vs_gemm_max" is the most ours/GEMM time ratio, where the GEMM is
the candidate named by the case's "gemm" key. Time the candidates side by side (tools.timing).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from npu_graph.kernels.indexer import lightning_indexer  # noqa: F401  (register the ops)

DECODE_CONTEXT = 16384
TOP_K = 2048


def indexer_case(seed: int = 0) -> dict[str, Any]:
    """Decode: 64 indexer heads of dim 128, 16K bf16 keys, top 2048; eager einsum + topk and the bare fp32
    GEMM (keys already fp32) that the fused op should stay close to."""
    g = torch.Generator().manual_seed(seed)
    n1, d = 64, 128
    q = torch.randn(1, 1, n1, d, generator=g).bfloat16()
    k = torch.randn(1, DECODE_CONTEXT, 1, d, generator=g).bfloat16()
    w = torch.randn(1, 1, n1, generator=g).bfloat16()
    k_f32 = k[0, :, 0].float()
    q_t = q[0, 0].float().t().contiguous()

    def eager() -> torch.Tensor:
        s = torch.einsum("bshd,btd->bsht", q.float(), k[:, :, 0].float()).relu()
        return (s * w.float()[..., None]).sum(2).topk(TOP_K, dim=-1).indices

    def ours() -> torch.Tensor:
        return torch.ops.ascend_dsa.lightning_indexer(q, k, w, sparse_count=TOP_K, sparse_mode=3)[0]

    candidates: dict[str, Callable[[], object]] = {"eager": eager, "fp32_gemm": lambda: k_f32 @ q_t,
                                                   "ascend_dsa": ours}
    return {"name": "lightning_indexer decode 64x128, 16K keys, top 2048, bf16", "candidates": candidates,
            "baseline": "eager", "ours": "ascend_dsa", "gemm": "fp32_gemm",
            "targets": {"speedup_vs_eager": 2.5, "time_vs_gemm_max": 1.2}}


def sparse_attention_case(seed: int = 0) -> dict[str, Any]:
    """Decode: 16 heads, MLA absorbed (512 latent + 64 rope), 2048 of 16K keys, bf16; eager gather + concat +
    softmax."""
    g = torch.Generator().manual_seed(seed)
    heads, latent, rope = 16, 512, 64
    q = torch.randn(1, 1, heads, latent, generator=g).bfloat16()
    q_rope = torch.randn(1, 1, heads, rope, generator=g).bfloat16()
    kv = torch.randn(1, DECODE_CONTEXT, 1, latent, generator=g).bfloat16()
    k_rope = torch.randn(1, DECODE_CONTEXT, 1, rope, generator=g).bfloat16()
    idx = torch.randperm(DECODE_CONTEXT, generator=g)[:TOP_K].int().view(1, 1, 1, TOP_K)
    scale = (latent + rope) ** -0.5

    def eager() -> torch.Tensor:
        i = idx.view(-1).long()
        keys = torch.cat([kv[0, i, 0], k_rope[0, i, 0]], -1).float()
        p = (torch.cat([q[0, 0], q_rope[0, 0]], -1).float() @ keys.T * scale).softmax(-1)
        return (p @ kv[0, i, 0].float()).view(1, 1, heads, latent)

    def ours() -> torch.Tensor:
        return torch.ops.ascend_dsa.sparse_flash_attention(q, kv, kv, idx, scale, query_rope=q_rope,
                                                           key_rope=k_rope)[0]

    return {"name": "sparse_flash_attention decode 16 heads, 512+64, 2048 of 16K keys, bf16",
            "candidates": {"eager": eager, "ascend_dsa": ours}, "baseline": "eager", "ours": "ascend_dsa",
            "targets": {"speedup_vs_eager": 3.0}}


def cases() -> list[dict[str, Any]]:
    return [indexer_case(), sparse_attention_case()]

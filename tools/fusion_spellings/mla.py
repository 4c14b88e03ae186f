"""MLA absorption spellings: top-k sparse MLA written in expanded form (per-head keys and values projected from the
latent by kv_b_proj, as transformers and most MLA code write it) -> absorbed into the latent, then
`ascend_dsa.sparse_flash_attention`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from npu_graph.tools.fusion_spellings import Family, Negative, Spelling
from npu_graph.tools.fusion_spellings.compare import close
from npu_graph.tools.fusion_spellings.sparse_attention import causal_top_k

B, T, S, HEADS, NOPE, ROPE, VALUE, LATENT, TOPK, HIDDEN = 1, 5, 16, 4, 16, 8, 12, 32, 6, 24


def _project(kind: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if kind == "functional":
        return F.linear(x, w)
    return x @ w.t() if kind == "matmul_t" else torch.matmul(x, w.transpose(0, 1))


def _keys_values(c: dict[str, str], kv: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    heads_rope = k_rope.expand(-1, HEADS, -1, -1)
    if c["pieces"] == "split":
        k_nope, value = torch.split(kv, [NOPE, VALUE], dim=-1)
        return torch.cat([k_nope, heads_rope], dim=-1), value
    k_nope, value = kv[..., :NOPE], kv[..., NOPE:]
    if c["pieces"] == "slices":
        return torch.cat((k_nope, heads_rope), -1), value
    key = kv.new_empty(kv.shape[0], HEADS, kv.shape[2], NOPE + ROPE)   # "copy"
    key[..., :NOPE].copy_(k_nope)
    key[..., NOPE:].copy_(heads_rope)
    return key, value


def _mask(kind: str, causal: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    if kind == "where":
        return torch.where(causal & ~dropped, 0.0, float("-inf"))
    low = torch.finfo(torch.float32).min
    return torch.zeros(causal.shape).masked_fill(~causal, low).masked_fill(dropped, low)   # "masked_fill"


class ExpandedMLA(nn.Module):
    def __init__(self, c: dict[str, str]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.wq = nn.Parameter(torch.randn(HEADS * (NOPE + ROPE), HIDDEN, generator=g) * HIDDEN ** -0.5)
        self.wkv_a = nn.Parameter(torch.randn(LATENT + ROPE, HIDDEN, generator=g) * HIDDEN ** -0.5)
        self.wkv_b = nn.Parameter(torch.randn(HEADS * (NOPE + VALUE), LATENT, generator=g) * LATENT ** -0.5)
        self.c = c

    def forward(self, x: torch.Tensor, hidden_kv: torch.Tensor, index_scores: torch.Tensor) -> torch.Tensor:
        c = self.c
        b, t, s = x.shape[0], x.shape[1], hidden_kv.shape[1]
        q = F.linear(x, self.wq).view(b, t, HEADS, NOPE + ROPE).transpose(1, 2)
        latent, k_rope = F.linear(hidden_kv, self.wkv_a).split([LATENT, ROPE], dim=-1)
        kv = _project(c["project"], latent, self.wkv_b).view(b, s, HEADS, NOPE + VALUE).transpose(1, 2)
        key, value = _keys_values(c, kv, k_rope.unsqueeze(1))
        causal, topk = causal_top_k(index_scores, t, s, TOPK)
        dropped = torch.ones(b, t, s, dtype=torch.bool).scatter(-1, topk, False).unsqueeze(1)
        scores = torch.matmul(q, key.transpose(2, 3))
        scores = scores * (NOPE + ROPE) ** -0.5 if c["scale"] == "multiply" else scores / (NOPE + ROPE) ** 0.5
        probs = torch.softmax(scores + _mask(c["mask"], causal, dropped), dim=-1)
        if c["values"] == "einsum":
            return torch.einsum("bhts,bhsv->bhtv", probs, value)
        return torch.matmul(probs, value)


def inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, T, HIDDEN, generator=g), torch.randn(B, S, HIDDEN, generator=g), \
        torch.randn(B, T, S, generator=g)


def build(c: dict[str, str]) -> Spelling:
    return Spelling("mla", dict(c), ExpandedMLA(c), inputs(), {"sparse_flash_attention": 1}, close(2e-5))


CHOICES = {
    "project": ("functional", "matmul_t", "matmul"),
    "pieces": ("split", "slices", "copy"),
    "scale": ("multiply", "divide"),
    "mask": ("where", "masked_fill"),
    "values": ("matmul", "einsum"),
}


def _per_head_rope() -> Spelling:
    """A RoPE key per head (not shared by the heads): no single latent head to absorb into."""
    module = ExpandedMLA({k: v[0] for k, v in CHOICES.items()})
    rope_heads = torch.randn(B, HEADS, S, ROPE, generator=torch.Generator().manual_seed(3))

    def mla(x: torch.Tensor, hidden_kv: torch.Tensor, index_scores: torch.Tensor) -> torch.Tensor:
        b, t, s = x.shape[0], x.shape[1], hidden_kv.shape[1]
        q = F.linear(x, module.wq).view(b, t, HEADS, NOPE + ROPE).transpose(1, 2)
        latent = F.linear(hidden_kv, module.wkv_a)[..., :LATENT]
        kv = F.linear(latent, module.wkv_b).view(b, s, HEADS, NOPE + VALUE).transpose(1, 2)
        k_nope, value = torch.split(kv, [NOPE, VALUE], dim=-1)
        key = torch.cat([k_nope, rope_heads], dim=-1)
        causal, topk = causal_top_k(index_scores, t, s, TOPK)
        dropped = torch.ones(b, t, s, dtype=torch.bool).scatter(-1, topk, False).unsqueeze(1)
        scores = torch.matmul(q, key.transpose(2, 3)) * 0.2 + _mask("where", causal, dropped)
        return torch.matmul(scores.softmax(-1), value)

    return Spelling("mla", {"negative": "per_head_rope"}, mla, inputs(), {"sparse_flash_attention": 0}, close())


FAMILY = Family("mla", CHOICES, build, (Negative("per_head_rope", _per_head_rope, "rope key"),))

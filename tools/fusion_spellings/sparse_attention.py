"""Sparse attention spellings (DSA's MLA in absorbed form): one latent KV head that is key and value, a shared RoPE
key, attention restricted to the top-k keys of each query, written as dense attention masked to the top-k indices
-> `ascend_dsa.sparse_flash_attention`. Queries and keys are projections of hidden states (the head count and dims
stay the model's under dynamic=True); the top-k comes from index scores given as an input."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from npu_graph.tools.fusion_spellings import Family, Negative, Spelling
from npu_graph.tools.fusion_spellings.compare import close

B, T, S, H, C, R, K, HIDDEN = 2, 6, 20, 4, 32, 8, 5, 24
NEG_INF = float("-inf")


def causal_top_k(index_scores: torch.Tensor, rows: int, keys: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the right-down causal [rows, keys] visibility, the top-`count` visible keys of each row)."""
    causal = torch.arange(keys)[None, :] <= torch.arange(keys - rows, keys)[:, None]
    return causal, index_scores.masked_fill(~causal, NEG_INF).topk(count, dim=-1).indices


def _scores(kind: str, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [b, t, h, d] · keys [b, s, d] -> [b, h, t, s]."""
    if kind == "einsum":
        return torch.einsum("bthd,bsd->bhts", q, keys)
    if kind == "matmul":
        return torch.matmul(q.transpose(1, 2), keys.transpose(-1, -2).unsqueeze(1))
    b, t, h, d = q.shape
    flat = torch.bmm(q.transpose(1, 2).reshape(b, h * t, d), keys.transpose(1, 2))   # "bmm"
    return flat.view(b, h, t, -1)


def _index_mask(kind: str, topk: torch.Tensor, causal: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """scores [b, h, t, s] masked to the top-k keys and the causal ones."""
    b, t, s = topk.shape[0], topk.shape[1], scores.shape[-1]
    if kind == "additive":
        index = torch.full((b, t, s), NEG_INF).scatter(-1, topk, 0.0)
        additive = torch.zeros(t, s).masked_fill(~causal, NEG_INF)
        return scores + (index + additive).unsqueeze(1)
    if kind == "bool_where":
        keep = torch.zeros(b, t, s, dtype=torch.bool).scatter(-1, topk, True) & causal
        return scores + torch.where(keep, 0.0, NEG_INF).unsqueeze(1)
    dropped = torch.ones(b, t, s, dtype=torch.bool).scatter(-1, topk, False)   # "masked_fill"
    additive = torch.zeros(b, t, s).masked_fill(~causal, torch.finfo(torch.float32).min)
    return scores + additive.masked_fill(dropped, torch.finfo(torch.float32).min).unsqueeze(1)


class SparseMLA(nn.Module):
    def __init__(self, c: dict[str, str]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.wq = nn.Parameter(torch.randn(H * (C + R), HIDDEN, generator=g) * HIDDEN ** -0.5)
        self.wkv = nn.Parameter(torch.randn(C + R, HIDDEN, generator=g) * HIDDEN ** -0.5)
        self.c = c

    def forward(self, x: torch.Tensor, kv: torch.Tensor, index_scores: torch.Tensor) -> torch.Tensor:
        c = self.c
        b, t, s = x.shape[0], x.shape[1], kv.shape[1]
        q = F.linear(x, self.wq).view(b, t, H, C + R)
        q_nope, q_rope = q[..., :C], q[..., C:]
        latent, k_rope = F.linear(kv, self.wkv).split([C, R], dim=-1)
        causal, topk = causal_top_k(index_scores, t, s, K)
        main, rope = _scores(c["scores"], q_nope, latent), _scores(c["scores"], q_rope, k_rope)
        scores = main + rope if c["sum"] == "main_first" else rope + main
        scale = (C + R) ** -0.5
        scores = scores * scale if c["scale"] == "multiply" else scores / (C + R) ** 0.5
        masked = _index_mask(c["mask"], topk, causal, scores)
        probs = F.softmax(masked, dim=-1) if c["softmax"] == "functional" else masked.softmax(-1)
        if c["values"] == "einsum":
            return torch.einsum("bhts,bsc->bthc", probs, latent)
        return torch.matmul(probs, latent.unsqueeze(1)).transpose(1, 2)


def inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, T, HIDDEN, generator=g), torch.randn(B, S, HIDDEN, generator=g), \
        torch.randn(B, T, S, generator=g)


def build(c: dict[str, str]) -> Spelling:
    return Spelling("sparse_attention", dict(c), SparseMLA(c), inputs(), {"sparse_flash_attention": 1}, close())


CHOICES = {
    "scores": ("einsum", "matmul", "bmm"),
    "sum": ("main_first", "rope_first"),
    "scale": ("multiply", "divide"),
    "mask": ("additive", "bool_where", "masked_fill"),
    "softmax": ("functional", "method"),
    "values": ("einsum", "matmul"),
}


def _separate_values() -> Spelling:
    """Values of their own (not the latent that is the key): not the absorbed form."""
    module = SparseMLA({k: v[0] for k, v in CHOICES.items()})
    values = torch.randn(B, H, S, C, generator=torch.Generator().manual_seed(2))

    def attention(x: torch.Tensor, kv: torch.Tensor, index_scores: torch.Tensor) -> torch.Tensor:
        b, t, s = x.shape[0], x.shape[1], kv.shape[1]
        q = F.linear(x, module.wq).view(b, t, H, C + R)[..., :C]
        latent = F.linear(kv, module.wkv)[..., :C]
        causal, topk = causal_top_k(index_scores, t, s, K)
        scores = _index_mask("additive", topk, causal, torch.einsum("bthd,bsd->bhts", q, latent) * 0.1)
        return torch.matmul(scores.softmax(-1), values)

    return Spelling("sparse_attention", {"negative": "separate_values"}, attention, inputs(),
                    {"sparse_flash_attention": 0}, close())


FAMILY = Family("sparse_attention", CHOICES, build, (Negative("separate_values", _separate_values, "absorbed"),))

"""Attention residual spellings (Kimi block attention residuals): h = Σ_n softmax_n(w · RMSNorm(v_n)) v_n over the
depth n of stacked sources -> `ascend_dsa.attn_res`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from npu_graph.tools.fusion_spellings import Family, Negative, Spelling
from npu_graph.tools.fusion_spellings.compare import close

N, B, T, D = 3, 2, 5, 32
EPS = 1e-6


def _norm(kind: str, v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if kind == "functional":
        return F.rms_norm(v, (v.shape[-1],), weight, EPS)
    if kind == "divide":
        return weight * (v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + EPS))
    return v * torch.rsqrt((v * v).mean(-1, keepdim=True) + EPS) * weight   # "rsqrt"


def _logits(kind: str, keys: torch.Tensor, w: torch.Tensor, depth: int) -> torch.Tensor:
    """w · keys over the hidden dim."""
    if kind == "einsum":
        return torch.einsum("d,nbtd->nbt", w, keys) if depth == 0 else torch.einsum("btnd,d->btn", keys, w)
    if kind == "mul_sum":
        return (keys * w).sum(dim=-1)
    return torch.matmul(keys, w.unsqueeze(-1)).squeeze(-1)   # "matmul"


def _mix(kind: str, p: torch.Tensor, v: torch.Tensor, depth: int) -> torch.Tensor:
    """Σ_n p[n] · v[n]."""
    if kind == "einsum":
        return torch.einsum("nbt,nbtd->btd", p, v) if depth == 0 else torch.einsum("btn,btnd->btd", p, v)
    if kind == "mul_sum":
        return (p.unsqueeze(-1) * v).sum(dim=depth)
    if depth == 0:
        return torch.matmul(p.permute(1, 2, 0).unsqueeze(-2), v.permute(1, 2, 0, 3)).squeeze(-2)
    return torch.matmul(p.unsqueeze(-2), v).squeeze(-2)   # "matmul"


class AttnRes(nn.Module):
    def __init__(self, c: dict[str, str]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.query = nn.Parameter(torch.randn(D, generator=g) * 0.3)
        self.weight = nn.Parameter(torch.rand(D, generator=g) + 0.5)
        self.c = c

    def forward(self, a: torch.Tensor, b: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        c = self.c
        depth = 0 if c["depth"] == "first" else 2
        values = torch.stack([a, b, partial], dim=depth)
        keys = _norm(c["norm"], values, self.weight)
        logits = _logits(c["logits"], keys, self.query, depth)
        logits = logits * D ** -0.5 if c["scale"] == "scaled" else logits
        p = F.softmax(logits, dim=depth) if c["softmax"] == "functional" else logits.softmax(depth - 3)
        return _mix(c["mix"], p, values, depth)


def inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(B, T, D, generator=g) * (i + 1) for i in range(N))


def build(c: dict[str, str]) -> Spelling:
    return Spelling("attn_res", dict(c), AttnRes(c), inputs(), {"attn_res": 1}, close())


CHOICES = {
    "depth": ("first", "third"),
    "norm": ("rsqrt", "divide", "functional"),
    "logits": ("einsum", "mul_sum", "matmul"),
    "scale": ("none", "scaled"),
    "softmax": ("method", "functional"),
    "mix": ("einsum", "mul_sum", "matmul"),
}


def _unnormalized() -> Spelling:
    """The logits read the raw values, not their RMSNorm: other math."""
    module = AttnRes({})

    def raw(a: torch.Tensor, b: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        values = torch.stack([a, b, partial])
        p = torch.einsum("d,nbtd->nbt", module.query, values).softmax(0)
        return torch.einsum("nbt,nbtd->btd", p, values)

    return Spelling("attn_res", {"negative": "no_norm"}, raw, inputs(), {"attn_res": 0}, close())


FAMILY = Family("attn_res", CHOICES, build, (Negative("no_norm", _unnormalized, "RMSNorm"),))

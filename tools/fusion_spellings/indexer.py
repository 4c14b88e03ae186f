"""Lightning indexer spellings: score[b,t,s] = Σ_h w[b,t,h]·relu(c·q[b,t,h]·k[b,s]) (c > 0), right-down causal,
top-k keys per query -> `ascend_dsa.lightning_indexer`. q, k and the head weights w are projections of the
hidden states (module parameters), so that `dynamic=True` makes the lengths symbolic, as in a model."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from npu_graph.tools.fusion_spellings import Family, Negative, Spelling
from npu_graph.tools.fusion_spellings.compare import same_picks

B, T, H, D, S, K, HIDDEN = 2, 6, 4, 16, 24, 8, 32
NEG_INF = float("-inf")


def _contract(kind: str, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, int]:
    """q·k over d as [b, t, h, s] (heads dim 2) or [b, h, t, s] (heads dim 1); returns (scores, heads dim)."""
    if kind == "einsum":
        return torch.einsum("bthd,bsd->bths", q, k), 2
    if kind == "einsum_bhts":
        return torch.einsum("bthd,bsd->bhts", q, k), 1
    if kind == "matmul":
        return q @ k.transpose(-1, -2).unsqueeze(1), 2
    if kind == "bmm":
        b, t, h, d = q.shape
        rows = torch.bmm(q.reshape(b, t * h, d), k.transpose(1, 2))
        return rows.view(b, t, h, -1), 2
    if kind == "mul_sum":
        return (q.unsqueeze(-2) * k[:, None, None]).sum(-1), 2
    return torch.matmul(k.unsqueeze(1), q.permute(0, 1, 3, 2)).permute(0, 1, 3, 2), 2   # "matmul_kq"


def _relu(kind: str, x: torch.Tensor) -> torch.Tensor:
    return {"relu": torch.relu, "functional": F.relu, "clamp_min": lambda t: t.clamp_min(0),
            "clamp": lambda t: torch.clamp(t, min=0.0), "maximum": lambda t: torch.maximum(t, torch.zeros_like(t)),
            "relu_inplace": lambda t: t.relu_()}[kind](x)


def _weigh(kind: str, s: torch.Tensor, w: torch.Tensor, heads: int) -> torch.Tensor:
    if heads == 1:
        s = s.transpose(1, 2)
    if kind == "mul_sum":
        return (s * w.unsqueeze(-1)).sum(dim=2)
    if kind == "commuted":
        return (w[..., None] * s).sum(2)
    if kind == "einsum":
        return torch.einsum("bths,bth->bts", s, w)
    return torch.matmul(w.unsqueeze(-2), s).squeeze(-2)   # "matmul"


def visible(kind: str, t: int, s: int, device: torch.device) -> torch.Tensor:
    """[t, s] bool: key j visible to query i iff j <= s - t + i, built the way `kind` says."""
    if kind == "tril":
        return torch.ones(t, s, dtype=torch.bool, device=device).tril(s - t)
    if kind == "triu":
        return ~torch.ones(t, s, dtype=torch.bool, device=device).triu(s - t + 1)
    if kind == "upper":     # not causal: each query sees the keys from its position on
        return torch.ones(t, s, dtype=torch.bool, device=device).triu(s - t)
    keys = torch.arange(s, device=device)
    return keys[None, :] <= torch.arange(s - t, s, device=device)[:, None]   # "arange"


def _mask(kind: str, score: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    if kind == "masked_fill":
        return score.masked_fill(~seen, NEG_INF)
    if kind == "where":
        return torch.where(seen, score, NEG_INF)
    if kind in ("additive_inf", "additive_min"):
        fill = NEG_INF if kind == "additive_inf" else torch.finfo(score.dtype).min
        return score + torch.zeros(seen.shape, dtype=score.dtype, device=score.device).masked_fill(~seen, fill)
    return score   # "none"


def _topk(kind: str, score: torch.Tensor, k: int) -> torch.Tensor:
    if kind == "getitem":
        return torch.topk(score, k, dim=-1)[1]
    if kind == "unsorted":
        return score.topk(k, dim=-1, sorted=False).indices
    if kind == "explicit":
        return torch.topk(score, k=k, dim=-1, largest=True, sorted=True).indices
    if kind == "dim_positive":
        return score.topk(k, 2).indices
    return score.topk(k, dim=-1).indices


def _project(kind: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if kind == "linear":
        return F.linear(x, w)
    return x @ w.t() if kind == "matmul_t" else torch.matmul(x, w.transpose(0, 1))


class Indexer(nn.Module):
    """The spelling `c`; `relu`, `weighted` and `seen_kind` substitute other math for the negatives."""

    def __init__(self, c: dict[str, str], relu=None, weighted: bool = True, seen_kind: str | None = None,
                 sizes: tuple[int, int, int, int] = (H, D, K, HIDDEN)) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.heads, self.dim, self.topk, hidden = sizes
        self.wq, self.wk, self.ww = (nn.Parameter(torch.randn(n, hidden, generator=g) * hidden ** -0.5)
                                     for n in (self.heads * self.dim, self.dim, self.heads))
        self.c, self.relu, self.weighted, self.seen_kind = c, relu, weighted, seen_kind

    def projections(self, x: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p = self.c.get("project", "linear")
        q = _project(p, x, self.wq).view(x.shape[0], x.shape[1], self.heads, self.dim)
        return q, _project(p, kv, self.wk), _project(p, x, self.ww)

    def forward(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        c, scale = self.c, self.dim ** -0.5
        q, k, w = self.projections(x, kv)
        q = q * scale if c["scale"] == "query" else q
        w = w * scale if c["scale"] == "weights" else w
        scores, heads = _contract(c["contract"], q, k)
        scores = self.relu(scores) if self.relu else _relu(c["relu"], scores)
        score = _weigh(c["weigh"], scores, w, heads) if self.weighted else scores.sum(heads)
        score = score * scale if c["scale"] == "score" else score
        score = score / self.dim ** 0.5 if c["scale"] == "divide" else score
        seen = visible(self.seen_kind or c["mask_build"], score.shape[-2], score.shape[-1], score.device)
        return _topk(c["topk"], _mask(c["mask"], score, seen), self.topk)

    def reference_scores(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        q, k, w = self.projections(x, kv)
        score = (torch.einsum("bthd,bsd->bths", q, k).relu() * w[..., None]).sum(2)
        return score.masked_fill(~visible("arange", score.shape[-2], score.shape[-1], score.device), NEG_INF)


def inputs(rows: int = T, keys: int = S, hidden: int = HIDDEN, batch: int = B) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, rows, hidden, generator=g), torch.randn(batch, keys, hidden, generator=g)


def build(c: dict[str, str], **substitute) -> Spelling:
    module = Indexer(c, **substitute)
    return Spelling("indexer", dict(c), module, inputs(), {"lightning_indexer": 1},
                    same_picks(module.reference_scores))


CHOICES = {
    "project": ("linear", "matmul_t", "matmul"),
    "contract": ("einsum", "einsum_bhts", "matmul", "bmm", "mul_sum", "matmul_kq"),
    "relu": ("relu", "functional", "clamp_min", "clamp", "maximum", "relu_inplace"),
    "scale": ("none", "query", "weights", "score", "divide"),
    "weigh": ("mul_sum", "commuted", "einsum", "matmul"),
    "mask_build": ("tril", "triu", "arange"),
    "mask": ("masked_fill", "where", "additive_inf", "additive_min", "none"),
    "topk": ("indices", "getitem", "unsorted", "explicit", "dim_positive"),
}
PLAIN = {"project": "linear", "contract": "einsum", "relu": "relu", "scale": "none", "weigh": "mul_sum",
         "mask_build": "arange", "mask": "masked_fill", "topk": "indices"}


def _negative(name: str, reason: str, **substitute) -> Negative:
    def build_negative() -> Spelling:
        spelling = build(PLAIN, **substitute)
        spelling.fused = {"lightning_indexer": 0}
        spelling.choice = {"negative": name}
        return spelling

    return Negative(name, build_negative, reason)


FAMILY = Family("indexer", CHOICES, build, (
    _negative("gelu", "gelu", relu=F.gelu),
    _negative("no_head_weights", "head", weighted=False),
    _negative("non_causal_mask", "causal", seen_kind="upper"),
))

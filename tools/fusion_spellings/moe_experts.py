"""Routed SwiGLU expert spellings: out = Σ_e expert_e(x) · Σ_j w[:, j]·(ids[:, j] == e) with ids, w a top-k of the
router, expert_e(x) = down_e(silu(gate_e(x)) · up_e(x)), as a loop over the experts or densely (every expert on
every token by bmm or einsum over stacked weights, combined with the routing weights scattered to [T, E], or each
routed slot's expert row picked, weighted and index_add-ed back onto its token) -> `ascend_dsa.fused_moe` (and the
router's `moe_gating_top_k`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from npu_graph.tools.fusion_spellings import Family, Negative, Spelling
from npu_graph.tools.fusion_spellings.compare import close

TOKENS, HIDDEN, INTER, E, K = 7, 16, 8, 6, 2


def _linear(kind: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if kind == "functional":
        return F.linear(x, w)
    return x @ w.t() if kind == "matmul_t" else torch.matmul(x, w.transpose(0, 1))


def _act(kind: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if kind == "silu_first":
        return F.silu(gate) * up
    if kind == "up_first":
        return up * F.silu(gate)
    return up * (gate * torch.sigmoid(gate))   # "sigmoid"


def _slot_weight(kind: str, weights: torch.Tensor, ids: torch.Tensor, e: int) -> torch.Tensor:
    """Σ_j w[:, j]·(ids[:, j] == e) as a [T, 1] column."""
    if kind == "where":
        return torch.where(ids == e, weights, 0.0).sum(-1, keepdim=True)
    if kind == "float_mask":
        return (weights * (ids == e).to(weights.dtype)).sum(dim=-1, keepdim=True)
    return (weights * (ids == e)).sum(dim=-1, keepdim=True)   # "bool_mask"


def _stacked(kind: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H] (or [E, T, H]) through every expert's weight w [E, O, H]: [E, T, O]."""
    if kind == "einsum":
        return torch.einsum("th,eoh->eto", x, w) if x.dim() == 2 else torch.einsum("eth,eoh->eto", x, w)
    xs = x.unsqueeze(0).expand(w.shape[0], -1, -1) if x.dim() == 2 else x
    return torch.bmm(xs, w.transpose(1, 2))   # "bmm"


def _routing_matrix(kind: str, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if kind == "scatter_add":
        return torch.zeros(ids.shape[0], E).scatter_add(1, ids, weights)
    return torch.zeros(ids.shape[0], E, dtype=weights.dtype).scatter(1, ids, weights)   # "scatter"


def _index_add(kind: str, x: torch.Tensor, outs: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor) -> torch.Tensor:
    """Σ over the routed slots (t, j) of outs[ids[t, j], t] · w[t, j], added onto row t by index_add."""
    t, k = ids.shape
    if kind == "index_add":
        tokens = torch.arange(t).unsqueeze(1).expand(t, k).reshape(-1)
    else:   # "index_add_inplace": the token of slot s is s // k
        tokens = torch.div(torch.arange(t * k), k, rounding_mode="floor")
    picked = outs[ids.reshape(-1), tokens] * weights.reshape(-1, 1)
    if kind == "index_add":
        return torch.zeros_like(x).index_add(0, tokens, picked)
    out = x.new_zeros(x.shape)
    out.index_add_(0, tokens, picked)
    return out


class Experts(nn.Module):
    def __init__(self, c: dict[str, str]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.router = nn.Parameter(torch.randn(E, HIDDEN, generator=g) * 0.3)
        self.gate, self.up = (nn.ParameterList(nn.Parameter(torch.randn(INTER, HIDDEN, generator=g) * 0.3)
                                               for _ in range(E)) for _ in range(2))
        self.down = nn.ParameterList(nn.Parameter(torch.randn(HIDDEN, INTER, generator=g) * 0.3) for _ in range(E))
        self.c = c

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        p = self.c["linear"]
        hidden = _act(self.c["act"], _linear(p, x, self.gate[e]), _linear(p, x, self.up[e]))
        return _linear(p, hidden, self.down[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        weights, ids = F.linear(x, self.router).softmax(-1).topk(K, dim=-1)
        if c["form"] == "dense":
            return self.dense(x, weights, ids)
        terms = []
        for e in (range(E) if c["order"] == "ascending" else reversed(range(E))):
            weight = _slot_weight(c["slot"], weights, ids, e)
            out = self.expert(e, x)
            terms.append(out * weight if c["weigh"] == "after" else weight * out)
        if c["combine"] == "stack_sum":
            return torch.stack(terms).sum(0)
        total = torch.zeros_like(x) if c["combine"] == "zeros" else terms.pop(0)
        for term in terms:
            total = total + term
        return total

    def dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token over stacked weights, combined by the routing weights scattered to [T, E]."""
        c = self.c
        gate, up, down = (torch.stack(list(p)) for p in (self.gate, self.up, self.down))
        hidden = _act(c["act"], _stacked(c["stacked"], x, gate), _stacked(c["stacked"], x, up))
        outs = _stacked(c["stacked"], hidden, down)                    # [E, T, H]
        if c["combine_dense"].startswith("index_add"):
            return _index_add(c["combine_dense"], x, outs, weights, ids)
        routing = _routing_matrix(c["scatter"], weights, ids)          # [T, E]
        if c["combine_dense"] == "einsum":
            return torch.einsum("te,eth->th", routing, outs)
        return (routing.t().unsqueeze(-1) * outs).sum(0)   # "mul_sum"


def inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1)),)


def settle(c: dict[str, str]) -> dict[str, str]:
    """The loop reads linear/slot/weigh/order/combine, the dense form stacked/scatter/combine_dense (scatter only
    when it combines by a routing matrix)."""
    c = dict(c)
    if c["form"] == "loop":
        c.update(stacked="bmm", scatter="scatter", combine_dense="einsum")
    else:
        c.update(linear="functional", slot="where", weigh="after", order="ascending", combine="zeros")
        if c["combine_dense"].startswith("index_add"):
            c.update(scatter="scatter")
    return c


def build(c: dict[str, str]) -> Spelling:
    return Spelling("moe_experts", dict(c), Experts(c), inputs(), {"fused_moe": 1}, close())


CHOICES = {
    "form": ("loop", "loop", "dense"),
    "stacked": ("bmm", "einsum"),
    "scatter": ("scatter", "scatter_add"),
    "combine_dense": ("einsum", "mul_sum", "index_add", "index_add_inplace"),
    "linear": ("functional", "matmul_t", "matmul"),
    "act": ("silu_first", "up_first", "sigmoid"),
    "slot": ("where", "float_mask", "bool_mask"),
    "weigh": ("after", "before"),
    "order": ("ascending", "descending"),
    "combine": ("zeros", "first", "stack_sum"),
}


def _gelu_experts() -> Spelling:
    """GELU where SwiGLU has silu: other math."""
    module = Experts({k: v[0] for k, v in CHOICES.items()})

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(F.linear(x, module.gate[e])) * F.linear(x, module.up[e])
        return F.linear(hidden, module.down[e])

    module.expert = expert
    return Spelling("moe_experts", {"negative": "gelu"}, module, inputs(), {"fused_moe": 0}, close())


FAMILY = Family("moe_experts", CHOICES, build, (Negative("gelu", _gelu_experts, "expert"),), settle=settle)

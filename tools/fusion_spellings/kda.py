"""KDA / gated delta rule step spellings (one decode step of Kimi Delta Attention, fla's fused_recurrent_kda as
model code): S' = S·exp(g) + k ⊗ β(v − k·S·exp(g)), o = q·S' -> `ascend_dsa.chunk_kda` over one token. q, k, v,
g and β are projections of the hidden state (the head count and dims stay the model's under dynamic=True); the
state comes in, as a cache holds it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from npu_graph.tools.fusion_spellings import Family, Negative, Spelling
from npu_graph.tools.fusion_spellings.compare import close

B, H, DK, DV, HIDDEN = 2, 3, 8, 6, 16


def _decay(kind: str, state: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    if kind == "index":
        return g.exp()[..., None] * state
    if kind == "exp_of_unsqueezed":
        return state * torch.exp(g.unsqueeze(-1))
    return state * g.exp().unsqueeze(-1)   # "unsqueeze"


def _read(kind: str, vec: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Σ_k vec[k] · state[k, :]."""
    if kind == "einsum":
        return torch.einsum("bhk,bhkv->bhv", vec, state)
    if kind == "matmul":
        return (vec.unsqueeze(-2) @ state).squeeze(-2)
    return (vec[..., None] * state).sum(-2)   # "mul_sum"


def _outer(kind: str, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    if kind == "einsum":
        return torch.einsum("bhk,bhv->bhkv", k, delta)
    if kind == "matmul":
        return k.unsqueeze(-1) @ delta.unsqueeze(-2)
    return k[..., None] * delta[..., None, :]   # "broadcast"


class KDAStep(nn.Module):
    def __init__(self, c: dict[str, str]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.proj = nn.Parameter(torch.randn(H * (3 * DK + DV + 1), HIDDEN, generator=g) * HIDDEN ** -0.5)
        self.c = c

    def inputs_of(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b = x.shape[0]
        q, k, v, g, beta = F.linear(x, self.proj).view(b, H, -1).split([DK, DK, DV, DK, 1], dim=-1)
        if self.c.get("normalize") == "rsqrt":     # q and k as fla's l2norm: x · rsqrt(Σ x² + eps)
            q, k = (t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
        else:
            k = F.normalize(k, dim=-1)
        return q, k, v, -F.softplus(g), beta.squeeze(-1).sigmoid()

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.c
        q, k, v, g, beta = self.inputs_of(x)
        decayed = _decay(c["decay"], state, g)
        error = v - _read(c["read"], k, decayed)
        delta = beta[..., None] * error if c["beta"] == "first" else error * beta.unsqueeze(-1)
        outer = _outer(c["outer"], k, delta)
        new = decayed + outer if c["update"] == "decayed_first" else outer + decayed
        scale = DK ** -0.5
        if c["scale"] == "query":
            return _read(c["output"], q * scale, new), new
        return _read(c["output"], q, new) * scale, new


def inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, HIDDEN, generator=g), torch.randn(B, H, DK, DV, generator=g) * 0.5


def build(c: dict[str, str]) -> Spelling:
    return Spelling("kda", dict(c), KDAStep(c), inputs(), {"chunk_kda": 1}, close())


CHOICES = {
    "decay": ("unsqueeze", "index", "exp_of_unsqueezed"),
    "read": ("einsum", "matmul", "mul_sum"),
    "beta": ("first", "last"),
    "outer": ("broadcast", "einsum", "matmul"),
    "update": ("decayed_first", "outer_first"),
    "output": ("einsum", "matmul", "mul_sum"),
    "scale": ("query", "output"),
    "normalize": ("functional", "rsqrt"),
}


def _no_decay() -> Spelling:
    """The delta rule without the gate's decay (plain DeltaNet): another recurrence."""
    module = KDAStep({})

    def delta_net(x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, _, beta = module.inputs_of(x)
        delta = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, state))
        new = state + k[..., None] * delta[..., None, :]
        return torch.einsum("bhk,bhkv->bhv", q, new), new

    return Spelling("kda", {"negative": "no_decay"}, delta_net, inputs(), {"chunk_kda": 0}, close())


FAMILY = Family("kda", CHOICES, build, (Negative("no_decay", _no_decay, "decay"),))

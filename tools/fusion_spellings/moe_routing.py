"""MoE routing spellings: experts picked by top-k over softmax or sigmoid router scores (a per-expert correction
bias steering the choice only), optionally limited to the best groups of experts, weights gathered from the scores
and renormalised -> `ascend_dsa.moe_gating_top_k`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from npu_graph.tools.fusion_spellings import Family, Negative, Spelling
from npu_graph.tools.fusion_spellings.compare import same_routing

TOKENS, HIDDEN, E, K, GROUPS, KEEP = 7, 16, 16, 4, 4, 2
SCALE = 2.5


def _logits(kind: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if kind == "linear":
        return F.linear(x, w)
    if kind == "matmul_t":
        return torch.matmul(x, w.t())
    return x @ w.T   # "matmul"


def _norm(kind: str, logits: torch.Tensor) -> torch.Tensor:
    if kind == "stable_softmax":
        e = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
        return e / e.sum(dim=-1, keepdim=True)
    return {"softmax": lambda t: t.softmax(dim=-1), "functional_softmax": lambda t: F.softmax(t, dim=-1),
            "exp_softmax": lambda t: t.exp() / t.exp().sum(-1, keepdim=True),
            "log_softmax_exp": lambda t: F.log_softmax(t, dim=-1).exp(),
            "sigmoid": torch.sigmoid, "method_sigmoid": lambda t: t.sigmoid(),
            "manual_sigmoid": lambda t: 1.0 / (1.0 + torch.exp(-t))}[kind](logits)


def _group_limit(c: dict[str, str], choice: torch.Tensor) -> torch.Tensor:
    """choice with the experts outside the KEEP best groups at -inf."""
    grouped = choice.view(choice.shape[0], GROUPS, -1)
    top2 = c["group_score"] == "top2"
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if top2 else grouped.amax(dim=-1)
    group_idx = torch.topk(group_scores, k=KEEP, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    if c["group_mask"] in ("flat", "flat_eq"):
        mask = keep.unsqueeze(-1).expand(-1, GROUPS, E // GROUPS).reshape(choice.shape[0], -1)
        hidden = mask == 0 if c["group_mask"] == "flat_eq" else ~mask.bool()
        return choice.masked_fill(hidden, float("-inf"))
    return torch.where(keep.bool().unsqueeze(-1), grouped, float("-inf")).view(choice.shape[0], -1)


def _ids(kind: str, choice: torch.Tensor) -> torch.Tensor:
    if kind == "getitem":
        return torch.topk(choice, k=K, dim=-1)[1]
    if kind == "unsorted":
        return choice.topk(K, dim=-1, sorted=False).indices
    return choice.topk(K, dim=-1).indices


class Router(nn.Module):
    def __init__(self, c: dict[str, str]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(E, HIDDEN, generator=g) * 0.3)
        self.register_buffer("bias", torch.randn(E, generator=g) * 0.1)
        self.c = c

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.c
        scores = _norm(c["norm"], _logits(c["logits"], x, self.weight))
        choice = scores + self.bias if c["bias"] == "bias" else scores
        if c["groups"] == "groups":
            choice = _group_limit(c, choice)
        if c["gather"] == "topk_values":
            weights, ids = torch.topk(choice, K, dim=-1)
        else:
            ids = _ids(c["topk"], choice)
            weights = scores.gather(1, ids) if c["gather"] == "gather" else torch.gather(scores, -1, ids)
        if c["renorm"] == "eps":
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        elif c["renorm"] == "plain":
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * SCALE if c["scale"] == "scaled" else weights, ids


def inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1)),)


def settle(c: dict[str, str]) -> dict[str, str]:
    """Sigmoid routing always renormalises (the fused op does); choices a path does not read are fixed."""
    c = dict(c)
    if "sigmoid" in c["norm"] and c["renorm"] == "none":
        c["renorm"] = "eps"
    if c["groups"] == "none":
        c.update(group_score="top2", group_mask="flat")
    if c["gather"] == "topk_values" and (c["bias"] == "bias" or c["groups"] == "groups"):
        c["gather"] = "gather"    # the top-k values are the routing weights only where they are the scores
    if c["gather"] == "topk_values":
        c["topk"] = "indices"
    return c


def build(c: dict[str, str]) -> Spelling:
    return Spelling("moe_routing", dict(c), Router(c), inputs(), {"moe_gating_top_k": 1}, same_routing())


CHOICES = {
    "logits": ("linear", "matmul", "matmul_t"),
    "norm": ("softmax", "functional_softmax", "stable_softmax", "exp_softmax", "log_softmax_exp", "sigmoid",
             "method_sigmoid", "manual_sigmoid"),
    "bias": ("bias", "none"),
    "groups": ("groups", "none"),
    "group_score": ("top2", "max"),
    "group_mask": ("flat", "flat_eq", "grouped"),
    "topk": ("indices", "getitem", "unsorted"),
    "gather": ("gather", "torch_gather", "topk_values"),
    "renorm": ("eps", "plain", "none"),
    "scale": ("scaled", "none"),
}


def _unnormalised_sigmoid() -> Spelling:
    c = {**{k: v[0] for k, v in CHOICES.items()}, "norm": "sigmoid", "renorm": "none"}
    return Spelling("moe_routing", {"negative": "sigmoid_not_renormalised"}, Router(c), inputs(),
                    {"moe_gating_top_k": 0}, same_routing())


FAMILY = Family("moe_routing", CHOICES, build,
                (Negative("sigmoid_not_renormalised", _unnormalised_sigmoid, "renormalis"),), settle=settle)

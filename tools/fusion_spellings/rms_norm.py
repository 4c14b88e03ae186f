"""RMSNorm spellings: y = x · rsqrt(mean(x², -1) + eps) (· w) in fp32 -> `ascend_dsa.rms_norm`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from npu_graph.tools.fusion_spellings import Family, Negative, Spelling
from npu_graph.tools.fusion_spellings.compare import close

ROWS, D = 6, 32
EPS = 1e-6


def _square(kind: str, x: torch.Tensor) -> torch.Tensor:
    return {"pow": lambda t: t.pow(2), "mul": lambda t: t * t, "square": torch.square,
            "power_op": lambda t: t ** 2}[kind](x)


def _mean(kind: str, sq: torch.Tensor) -> torch.Tensor:
    if kind == "sum_div":
        return sq.sum(-1, keepdim=True) / sq.shape[-1]
    if kind == "torch_mean":
        return torch.mean(sq, dim=-1, keepdim=True)
    return sq.mean(-1, keepdim=True)


def _normalize(kind: str, x: torch.Tensor, ms: torch.Tensor) -> torch.Tensor:
    if kind == "rsqrt":
        return x * torch.rsqrt(ms)
    if kind == "reciprocal_sqrt":
        return x * (1.0 / torch.sqrt(ms))
    if kind == "pow":
        return x * ms.pow(-0.5)
    return x / torch.sqrt(ms)   # "divide"


def _weight(kind: str, n: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if kind == "after":
        return n * w
    if kind == "before":
        return w * n
    if kind == "gemma":
        return n * (1.0 + w)
    return n   # "none"


class Norm(nn.Module):
    def __init__(self, c: dict[str, str]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(D, generator=torch.Generator().manual_seed(0)) + 0.5)
        self.eps, self.c = EPS, c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, w = self.c, self.weight
        if c["spelling"] == "functional":
            weight = None if c["weight"] == "none" else (1.0 + w if c["weight"] == "gemma" else w)
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        xf = x.float() if c["cast"] == "float" else x.to(torch.float32) if c["cast"] == "to" else x
        ms = _mean(c["mean"], _square(c["square"], xf))
        ms = ms + self.eps if c["eps"] == "after" else self.eps + ms
        y = _normalize(c["normalize"], xf, ms)
        return _weight(c["weight"], y.type_as(x) if c["cast"] != "none" else y, w)


def inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, ROWS, D, generator=torch.Generator().manual_seed(1)) * 3,)


def build(c: dict[str, str]) -> Spelling:
    return Spelling("rms_norm", dict(c), Norm(c), inputs(), {"rms_norm": 1}, close())


CHOICES = {
    "spelling": ("written", "written", "written", "functional"),
    "square": ("pow", "mul", "square", "power_op"),
    "mean": ("mean", "torch_mean", "sum_div"),
    "eps": ("after", "before"),
    "normalize": ("rsqrt", "reciprocal_sqrt", "pow", "divide"),
    "weight": ("after", "before", "gemma", "none"),
    "cast": ("none", "float", "to"),
}


def _abs_mean() -> Spelling:
    w = torch.rand(D, generator=torch.Generator().manual_seed(0)) + 0.5

    def l1_norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.abs().mean(-1, keepdim=True) + EPS) * w

    return Spelling("rms_norm", {"negative": "abs_mean"}, l1_norm, inputs(), {"rms_norm": 0}, close())


FAMILY = Family("rms_norm", CHOICES, build, (Negative("abs_mean", _abs_mean, "square"),))

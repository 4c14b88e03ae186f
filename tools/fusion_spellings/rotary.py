"""Rotary embedding spellings: x rotated pairwise by per-position angles, pairs taken as halves (x[:D/2],
x[D/2:]) or as even/odd values, written as rotate_half, as the two rotated halves, as stacked pairs or as a complex
product -> `ascend_dsa.rotary_mul`. x is a projection of the hidden states viewed as heads and the angles come from
integer positions (a model's own rotary module), so that `dynamic=True` makes batch and length symbolic and the
head dim stays the model's."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from npu_graph.tools.fusion_spellings import Family, Negative, Spelling
from npu_graph.tools.fusion_spellings.compare import close

B, S, H, D, HIDDEN = 2, 5, 3, 16, 32


def _halves(kind: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "chunk":
        return x.chunk(2, dim=-1)
    if kind == "split":
        return torch.split(x, x.shape[-1] // 2, dim=-1)
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]   # "slice"


def _pairs(kind: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "slice":
        return x[..., 0::2], x[..., 1::2]
    if kind == "unbind":
        return x.unflatten(-1, (-1, 2)).unbind(-1)
    pairs = x.reshape(*x.shape[:-1], -1, 2)   # "view"
    return pairs[..., 0], pairs[..., 1]


def _product(order: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b if order == "x_first" else b * a


def _rotated(c: dict[str, str], x1, x2, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """(x1·cos − x2·sin, x2·cos + x1·sin) in the spelling's operand order."""
    p = c["order"]
    if c["sum_order"] == "sin_first":
        return -_product(p, x2, sin) + _product(p, x1, cos), _product(p, x1, sin) + _product(p, x2, cos)
    return _product(p, x1, cos) - _product(p, x2, sin), _product(p, x2, cos) + _product(p, x1, sin)


def _rotate_half(c: dict[str, str], x, cos, sin) -> torch.Tensor:
    """x·cos + rotate(x)·sin with full-width angles."""
    if c["layout"] == "halves":
        x1, x2 = _halves(c["take"], x)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        x1, x2 = _pairs(c["take"], x)
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    p = c["order"]
    if c["sum_order"] == "sin_first":
        return _product(p, rotated, sin) + _product(p, x, cos)
    return _product(p, x, cos) + _product(p, rotated, sin)


def _full_width(c: dict[str, str], angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin over all D values: the angles repeated as the layout pairs them, before or after cos/sin."""
    def widen(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((t, t), dim=-1) if c["layout"] == "halves" else t.repeat_interleave(2, dim=-1)

    if c["angles"] == "widen_angles":
        angles = widen(angles)
        return angles.cos(), angles.sin()
    return widen(angles.cos()), widen(angles.sin())


class Rotary(nn.Module):
    def __init__(self, c: dict[str, str], sizes: tuple[int, int, int] = (H, D, HIDDEN)) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.heads, self.dim, hidden = sizes
        self.proj = nn.Parameter(torch.randn(self.heads * self.dim, hidden, generator=g) * hidden ** -0.5)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.dim, 2).float() / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.c = c

    def heads_and_angles(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.linear(hidden, self.proj).view(hidden.shape[0], hidden.shape[1], self.heads, self.dim)
        angles = positions[..., None].float() * self.inv_freq
        return x, angles[:, :, None] if self.c.get("broadcast") == "index" else angles.unsqueeze(2)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.c
        x, angles = self.heads_and_angles(hidden, positions)
        if c["form"] == "complex":
            freqs = torch.polar(torch.ones_like(angles), angles)
            z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(z * freqs).flatten(-2).type_as(x)
        if c["form"] == "rotate_half":
            return _rotate_half(c, x, *_full_width(c, angles))
        x1, x2 = (_halves if c["layout"] == "halves" else _pairs)(c["take"], x)
        first, second = _rotated(c, x1, x2, angles.cos(), angles.sin())
        if c["layout"] == "halves":
            return torch.cat((first, second), dim=-1)
        return torch.stack((first, second), dim=-1).flatten(-2)


def inputs(length: int = S, hidden: int = HIDDEN, batch: int = B) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    positions = torch.arange(3, 3 + length).expand(batch, length).contiguous()
    return torch.randn(batch, length, hidden, generator=g), positions


def settle(c: dict[str, str]) -> dict[str, str]:
    """A complex product takes even/odd pairs of x; halves are taken by chunk, split or slices, pairs by slices,
    unbind or a [.., D/2, 2] view; only rotate_half widens the angles."""
    c = dict(c)
    if c["form"] == "complex":
        c.update(layout="pairs", take="view", order="x_first", sum_order="cos_first")
    if c["form"] != "rotate_half":
        c["angles"] = "widen_cos"
    if c["layout"] == "halves" and c["take"] not in ("chunk", "split", "slice"):
        c["take"] = {"unbind": "split", "view": "chunk"}[c["take"]]
    if c["layout"] == "pairs" and c["take"] not in ("slice", "unbind", "view"):
        c["take"] = {"chunk": "unbind", "split": "view"}[c["take"]]
    return c


def build(c: dict[str, str]) -> Spelling:
    return Spelling("rotary", dict(c), Rotary(c), inputs(), {"rotary_mul": 1}, close())


CHOICES = {
    "form": ("pairs", "rotate_half", "complex"),
    "layout": ("halves", "pairs"),
    "take": ("chunk", "split", "slice", "unbind", "view"),
    "order": ("x_first", "angle_first"),
    "sum_order": ("cos_first", "sin_first"),
    "angles": ("widen_cos", "widen_angles"),
    "broadcast": ("unsqueeze", "index"),
}


def _no_rotation() -> Spelling:
    """x1·c + x2·s where a rotation subtracts: not a rotation."""
    module = Rotary({"form": "pairs"})

    def not_rotary(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, angles = module.heads_and_angles(hidden, positions)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * angles.cos() + x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()), dim=-1)

    return Spelling("rotary", {"negative": "no_rotation"}, not_rotary, inputs(), {"rotary_mul": 0}, close())


FAMILY = Family("rotary", CHOICES, build, (Negative("no_rotation", _no_rotation, "rotation"),), settle=settle)

"""Dynamic per-token int8 quantization of dispatched MoE rows (torch_npu's MC2 `quant_mode=2`).

Each row gets its own scale amax(|row|) / 127; the int8 row and its fp32 scale travel together as one int8
row of H + 4 bytes (the scale's bytes appended), so a single all-to-all moves both.
"""
from __future__ import annotations

import torch

QMAX = 127.0
SCALE_BYTES = 4     # one fp32 scale per row


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows [N,H], fp32 scales [N]) with x ≈ rows * scales[:, None]; an all-zero row gets scale 1."""
    amax = x.float().abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    rows = torch.round(x.float() / scale.unsqueeze(-1)).clamp(-QMAX, QMAX).to(torch.int8)
    return rows, scale


def dequantize_rows(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows * scale[:, None] in `dtype`."""
    return (rows.float() * scale.unsqueeze(-1)).to(dtype)


def pack(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [N, H + 4]: each row followed by the bytes of its fp32 scale."""
    return torch.cat([rows, scale.contiguous().view(torch.int8).view(-1, SCALE_BYTES)], dim=1)


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (int8 rows, fp32 scales) that `pack` joined."""
    rows = packed[:, :-SCALE_BYTES].contiguous()
    scale = packed[:, -SCALE_BYTES:].contiguous().view(torch.float32).view(-1)
    return rows, scale

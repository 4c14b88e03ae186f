"""Zigzag split for context parallelism: the sequence is cut into 2·cp chunks and rank r holds chunks r and
2·cp − 1 − r, so every rank gets one early (cheap under a causal mask) and one late (expensive) chunk and the
causal attention work per rank is balanced."""
from __future__ import annotations

import torch


def _check(length: int, cp_size: int, dim: int) -> int:
    if cp_size < 1:
        raise ValueError(f"zigzag: cp_size must be >= 1, got {cp_size}")
    chunks = 2 * cp_size
    if length % chunks:
        raise ValueError(f"zigzag: sequence length {length} along dim {dim} is not divisible by 2·cp_size = {chunks}; "
                         f"pad it to a multiple of {chunks}")
    return length // chunks


def zigzag_split(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int) -> torch.Tensor:
    """The part of `x` that rank `cp_rank` of `cp_size` holds: chunks cp_rank and 2·cp_size − 1 − cp_rank."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"zigzag: cp_rank {cp_rank} is outside [0, {cp_size})")
    chunk = _check(x.shape[dim], cp_size, dim)
    first = x.narrow(dim, cp_rank * chunk, chunk)
    second = x.narrow(dim, (2 * cp_size - 1 - cp_rank) * chunk, chunk)
    return torch.cat([first, second], dim=dim)


def zigzag_restore(parts: list[torch.Tensor], cp_size: int, dim: int) -> torch.Tensor:
    """Inverse of zigzag_split: `parts[r]` is rank r's piece; returns the sequence in its original order."""
    if len(parts) != cp_size:
        raise ValueError(f"zigzag: expected {cp_size} parts (one per rank), got {len(parts)}")
    chunk = _check(sum(p.shape[dim] for p in parts), cp_size, dim)
    ordered: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, part in enumerate(parts):
        if part.shape[dim] != 2 * chunk:
            raise ValueError(f"zigzag: rank {rank}'s part has length {part.shape[dim]} along dim {dim}, "
                             f"expected {2 * chunk}")
        ordered[rank], ordered[2 * cp_size - 1 - rank] = part.split(chunk, dim=dim)
    return torch.cat(ordered, dim=dim)

"""All-gathers over a CP group and the bookkeeping of a rank's zigzag chunks.

Under the zigzag layout (zigzag.py) rank r of cp holds global chunks r and 2·cp − 1 − r, each L tokens, in
that order. A query of global chunk c sees, causally, exactly the first (c + 1)·L keys, with its own chunk
last: the fused ops' causal mode aligned at the bottom right (`sparse_mode=3`: query i of S1 sees keys
<= S2 − S1 + i) expresses that when a chunk's queries are paired with that key prefix.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from npu_graph.parallel.groups import group_size_rank
from npu_graph.parallel.zigzag import zigzag_restore


class ZigzagChunk(NamedTuple):
    """One of a rank's two chunks: its rows in the local tensor and the causal key prefix it sees."""

    rows: slice
    visible: int


def zigzag_chunks(cp_size: int, cp_rank: int, local_length: int) -> list[ZigzagChunk]:
    """The two chunks of rank `cp_rank` whose local zigzag slice has `local_length` tokens."""
    if local_length % 2:
        raise ValueError(f"zigzag: a rank's slice holds two equal chunks, but its length is {local_length}; "
                         f"split sequences whose length is a multiple of 2·cp with zigzag_split")
    chunk = local_length // 2
    ids = (cp_rank, 2 * cp_size - 1 - cp_rank)
    return [ZigzagChunk(slice(j * chunk, (j + 1) * chunk), (c + 1) * chunk) for j, c in enumerate(ids)]


def gather_parts(local: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank's `local` (same shape on all ranks), in group-rank order; [local] without a group."""
    size, _ = group_size_rank(group)
    if size == 1:
        return [local]
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local, group=group)
    return parts


def gather_zigzag(local: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """The whole sequence, in its original order, from every rank's zigzag slice along `dim`."""
    parts = gather_parts(local, group)
    return zigzag_restore(parts, len(parts), dim)

"""The DSA lightning indexer under context parallelism (zigzag layout), its rows shared inside a TP group.

Each CP rank holds its zigzag slice of the queries, weights and indexer keys. The indexer keys are small
(one head of `index_head_dim` per token), so they are all-gathered and put back in sequence order; each of
the rank's two query chunks is then scored by the fused `lightning_indexer` against the key prefix it can
see (causal, bottom-right aligned), so a rank scores only the keys its chunks need. The selected indices are
global key positions. `gather_zigzag(indices, group, dim=1)` puts every rank's rows back in original order.

The ranks of a `row_group` (the TP group: they hold the same tokens) share that work instead of repeating
it: rank t of n scores rows [t·L/n, (t + 1)·L/n) of each chunk, against the keys up to its last row, and an
all-gather inside the row group assembles the chunk's indices.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from npu_graph.parallel.cp_gather import ZigzagChunk, gather_parts, gather_zigzag, zigzag_chunks
from npu_graph.parallel.groups import group_size_rank


def _check_local(query: torch.Tensor, key: torch.Tensor) -> None:
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(f"cp_lightning_indexer: query [B,S,N1,D] and key [B,S,1,D] must be 4-D (BSND), got "
                         f"{tuple(query.shape)} and {tuple(key.shape)}")
    if query.shape[1] != key.shape[1]:
        raise ValueError(f"cp_lightning_indexer: the local query slice has {query.shape[1]} tokens but the local "
                         f"key slice {key.shape[1]}; both must be this rank's zigzag slice of one sequence")


def _row_share(chunk: ZigzagChunk, row_group: dist.ProcessGroup | None) -> ZigzagChunk:
    """This rank's equal share of the chunk's rows, with the key prefix its last row sees."""
    size, rank = group_size_rank(row_group)
    length = chunk.rows.stop - chunk.rows.start
    if length % size:
        raise ValueError(f"cp_lightning_indexer: a zigzag chunk of {length} tokens does not split over the "
                         f"{size} ranks of row_group; use a sequence length divisible by 2·cp·{size}")
    share = length // size
    start = chunk.rows.start + rank * share
    return ZigzagChunk(slice(start, start + share), chunk.visible - length + (rank + 1) * share)


def cp_lightning_indexer(query: torch.Tensor, key: torch.Tensor, weights: torch.Tensor,
                         group: dist.ProcessGroup | None, *, sparse_count: int,
                         query_scale: torch.Tensor | None = None, key_scale: torch.Tensor | None = None,
                         row_group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`sparse_count` global key positions for this rank's zigzag query slice.

    query [B,2L,N1,D], key [B,2L,1,D], weights [B,2L,N1] (and the optional MXFP8 scales) are this rank's
    zigzag slices of a prefill from position 0; every rank of `row_group` passes the same slice. Returns
    (sparse_indices int32 [B,2L,1,K], sparse_values fp32 [B,2L,1,K]) as
    `torch.ops.ascend_dsa.lightning_indexer` with `sparse_mode=3` gives them for these rows on the whole
    sequence.
    """
    _check_local(query, key)
    size, rank = group_size_rank(group)
    keys = gather_zigzag(key, group, dim=1)
    key_scales = gather_zigzag(key_scale, group, dim=1) if key_scale is not None else None
    indices, values = [], []
    for chunk in zigzag_chunks(size, rank, query.shape[1]):
        rows, visible = _row_share(chunk, row_group)
        idx, val = torch.ops.ascend_dsa.lightning_indexer(
            query[:, rows], keys[:, :visible], weights[:, rows],
            query_scale=query_scale[:, rows] if query_scale is not None else None,
            key_scale=key_scales[:, :visible] if key_scales is not None else None,
            sparse_count=sparse_count, sparse_mode=3)
        indices += gather_parts(idx, row_group)
        values += gather_parts(val, row_group)
    return torch.cat(indices, dim=1), torch.cat(values, dim=1)

"""DSA sparse attention (MLA absorbed form) under context parallelism (zigzag layout).

Each CP rank holds its zigzag slice of the queries and of the per-token KV: the MLA latent (one head shared
by all query heads, kv_lora_rank values) and its RoPE key. A query may select any earlier position, and the
late chunk of every rank sees almost the whole sequence, so the KV slices are all-gathered once and put
back in sequence order; each of the rank's two query chunks then runs the fused `sparse_flash_attention`
over the KV prefix it can see, reading only the rows its `sparse_indices` (global positions, as the CP
indexer returns them) select.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from npu_graph.parallel.cp_gather import gather_zigzag, zigzag_chunks
from npu_graph.parallel.groups import group_size_rank


def cp_sparse_attention(query: torch.Tensor, key: torch.Tensor, sparse_indices: torch.Tensor, scale_value: float,
                        group: dist.ProcessGroup | None, *, value: torch.Tensor | None = None,
                        query_rope: torch.Tensor | None = None,
                        key_rope: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse attention of this rank's zigzag query slice over the whole sequence's selected KV rows.

    query [B,2L,N1,Dl], key (and value; None means value is key, the MLA latent) [B,2L,1,Dl],
    query_rope [B,2L,N1,Dr] and key_rope [B,2L,1,Dr] are this rank's zigzag slices; sparse_indices
    [B,2L,1,K] holds global positions (-1 skipped). Returns (attention_out, softmax_max, softmax_sum) for
    the local rows, as `torch.ops.ascend_dsa.sparse_flash_attention` with `sparse_mode=3` gives them for
    these rows on the whole sequence.
    """
    if query.shape[1] != key.shape[1] or sparse_indices.shape[1] != query.shape[1]:
        raise ValueError(f"cp_sparse_attention: query, key and sparse_indices must be this rank's zigzag slice "
                         f"(same length in dim 1), got {query.shape[1]}, {key.shape[1]}, {sparse_indices.shape[1]}")
    size, rank = group_size_rank(group)
    keys = gather_zigzag(key, group, dim=1)
    values = keys if value is None else gather_zigzag(value, group, dim=1)
    key_ropes = gather_zigzag(key_rope, group, dim=1) if key_rope is not None else None
    outs: list[list[torch.Tensor]] = [[], [], []]
    for chunk in zigzag_chunks(size, rank, query.shape[1]):
        rows, visible = chunk.rows, chunk.visible
        result = torch.ops.ascend_dsa.sparse_flash_attention(
            query[:, rows], keys[:, :visible], values[:, :visible], sparse_indices[:, rows], scale_value,
            query_rope=query_rope[:, rows] if query_rope is not None else None,
            key_rope=key_ropes[:, :visible] if key_ropes is not None else None, sparse_mode=3)
        for parts, part in zip(outs, result):
            parts.append(part)
    out, softmax_max, softmax_sum = (torch.cat(parts, dim=1) for parts in outs)
    return out, softmax_max, softmax_sum

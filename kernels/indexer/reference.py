"""The readable definition of `ascend_dsa::lightning_indexer`, one query row at a time in fp32: the reference
the fast paths are tested against (kernels/indexer/lightning_indexer.py has the op's contract)."""
import math

import torch
from torch import Tensor

from npu_graph.kernels.indexer.checks import OP, check_static, sequence_lengths, visible_keys
from npu_graph.kernels.indexer.keys import dequantize


def reference_lightning_indexer(query: Tensor, key: Tensor, weights: Tensor,
                                actual_seq_lengths_query: Tensor | None = None,
                                actual_seq_lengths_key: Tensor | None = None, block_table: Tensor | None = None,
                                query_scale: Tensor | None = None, key_scale: Tensor | None = None, *,
                                layout_query: str = "BSND", layout_key: str = "BSND", sparse_count: int = 2048,
                                sparse_mode: int = 3, return_value: bool = False) -> tuple[Tensor, Tensor]:
    """The definition, one query row at a time in fp32: score all visible keys, keep the top K."""
    check_static(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
                  query_scale, key_scale, layout_query, layout_key, sparse_count, sparse_mode)
    lq, lk = sequence_lengths(OP, query, key, block_table, actual_seq_lengths_query,
                              actual_seq_lengths_key, "actual_seq_lengths_key")
    q, w = dequantize(query, query_scale), weights.float()
    keys = dequantize(key, key_scale)[:, :, 0]
    batch, s1 = query.shape[:2]
    indices = torch.full((batch, s1, 1, sparse_count), -1, dtype=torch.int32)
    values = torch.full((batch, s1, 1, sparse_count), float("-inf"), dtype=torch.float32)
    for b in range(batch):
        if block_table is None:
            kb = keys[b]
        else:
            kb = keys[block_table[b, :math.ceil(lk[b] / key.shape[1])].long()].flatten(0, 1)
        for t in range(lq[b]):
            n = visible_keys(t, lq[b], lk[b], sparse_mode)
            if n == 0:
                continue
            score = (torch.relu(q[b, t] @ kb[:n].T) * w[b, t, :, None]).sum(0)
            top = score.topk(min(sparse_count, n))
            chosen = top.indices.masked_fill(top.values == float("-inf"), -1)     # -inf counts as masked
            indices[b, t, 0, :top.indices.numel()] = chosen.to(torch.int32)
            values[b, t, 0, :top.values.numel()] = top.values
    return indices, values

"""The readable definition of `ascend_dsa::sparse_flash_attention`, one query token at a time in fp32: the
reference the fast paths are tested against (kernels/sparse_attention/sparse_flash_attention.py has the op's
contract)."""
import torch
from torch import Tensor

from npu_graph.kernels.indexer.checks import sequence_lengths, visible_keys
from npu_graph.kernels.sparse_attention.checks import OP, check_data, check_scale, check_static
from npu_graph.kernels.sparse_attention.torch_path import dequantize_tiles


def _dense_rows(x: Tensor, scale: Tensor | None, block_table: Tensor | None, b: int, length: int) -> Tensor:
    """The first `length` rows [length, D] of batch b in fp32, read from BSND or through the block table."""
    rows = dequantize_tiles(x, scale)[:, :, 0]
    if block_table is None:
        return rows[b, :length]
    blocks = block_table[b, :-(-length // x.shape[1])].long()
    return rows[blocks].flatten(0, 1)[:length]


def reference_positions(indices: list[int], block: int, limit: int) -> list[int]:
    return [p for i in indices if 0 <= i * block < limit for p in range(i * block, min((i + 1) * block, limit))]


def reference_sparse_flash_attention(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor,
                                     scale_value: float, block_table: Tensor | None = None,
                                     actual_seq_lengths_query: Tensor | None = None,
                                     actual_seq_lengths_kv: Tensor | None = None, query_rope: Tensor | None = None,
                                     key_rope: Tensor | None = None, key_scale: Tensor | None = None,
                                     value_scale: Tensor | None = None, key_rope_scale: Tensor | None = None, *,
                                     sparse_block_size: int = 1, layout_query: str = "BSND", layout_kv: str = "BSND",
                                     sparse_mode: int = 3, return_softmax_lse: bool = False
                                     ) -> tuple[Tensor, Tensor, Tensor]:
    """The definition, one query token at a time in fp32: list its positions, softmax over their logits."""
    check_static(query, key, value, sparse_indices, block_table, actual_seq_lengths_query, actual_seq_lengths_kv,
                  query_rope, key_rope, key_scale, value_scale, sparse_block_size, layout_query, layout_kv,
                  sparse_mode, key_rope_scale)
    check_scale(scale_value)
    check_data(sparse_indices)
    lq, lkv = sequence_lengths(OP, query, key, block_table, actual_seq_lengths_query, actual_seq_lengths_kv,
                               "actual_seq_lengths_kv")
    out = torch.zeros(query.shape, dtype=torch.float32)
    softmax_max = torch.full(query.shape[:3], float("-inf"), dtype=torch.float32)
    softmax_sum = torch.zeros(query.shape[:3], dtype=torch.float32)
    for b in range(query.shape[0]):
        k = _dense_rows(key, key_scale, block_table, b, lkv[b])
        v = _dense_rows(value, value_scale, block_table, b, lkv[b])
        kr = None if key_rope is None else _dense_rows(key_rope, key_rope_scale, block_table, b, lkv[b])
        for t in range(lq[b]):
            limit = visible_keys(t, lq[b], lkv[b], sparse_mode)
            pos = torch.tensor(reference_positions(sparse_indices[b, t, 0].tolist(), sparse_block_size, limit),
                               dtype=torch.long)
            if pos.numel() == 0:
                continue
            logits = (query[b, t].float() * scale_value) @ k[pos].T       # scale_value multiplies the query
            if kr is not None:
                logits = logits + (query_rope[b, t].float() * scale_value) @ kr[pos].T
            row_max = logits.max(-1).values
            e = torch.exp(logits - row_max[:, None])
            out[b, t] = (e @ v[pos]) / e.sum(-1, keepdim=True)
            softmax_max[b, t], softmax_sum[b, t] = row_max, e.sum(-1)
    return non_finite_heads(out.to(query.dtype), softmax_max, softmax_sum)


def non_finite_heads(out: Tensor, softmax_max: Tensor, softmax_sum: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The op's outputs with its rule for non-finite logits applied in place (kernels/sparse_flash_attention.py):
    a head whose largest logit is NaN or +inf gets NaN in all three outputs, one whose every logit is -inf counts
    as having no selected position (0, -inf, 0). One check when every head is finite."""
    bad = ~torch.isfinite(softmax_max)
    if not bool(bad.any()):
        return out, softmax_max, softmax_sum
    empty = softmax_max == float("-inf")
    poisoned = bad & ~empty
    out.masked_fill_(empty.unsqueeze(-1), 0.0).masked_fill_(poisoned.unsqueeze(-1), float("nan"))
    softmax_sum.masked_fill_(empty, 0.0).masked_fill_(poisoned, float("nan"))
    softmax_max.masked_fill_(poisoned, float("nan"))
    return out, softmax_max, softmax_sum

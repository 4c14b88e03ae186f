"""The torch path of `ascend_dsa::sparse_flash_attention`, one query token at a time: its valid positions are
listed, the rows gathered once with index_select straight from the BSND tensor or the paged cache and converted to
fp32 into per-thread scratch buffers (once for key and value when they are the same tensor), and two GEMMs over all
heads do the logits (the rope part as its own small GEMM, no concatenation; scale_value folded into the query) and
the output. The output GEMM takes the stored bf16 rows directly when query and value are bf16, the rows are many
(LARGE_PV_ELEMS) and the CPU has native bf16 dot products (AVX512-BF16): the probabilities are normalized in fp32
and rounded to bf16 once. Also the fp8 KV dequantization the reference and the native path share."""
from typing import NamedTuple

import torch
from torch import Tensor

from npu_graph.kernels.indexer.checks import visible_keys
from npu_graph.kernels.indexer.keys import KeyReader, fp8_e4m3_to_float, linear, onednn_bf16

# Gathered value rows x latent dim from which P·V goes through oneDNN (bf16 where bf16_values allows, else
# fp32 linear on the transposed view, ~1.5x torch.mm at 2048 rows); below it torch.mm's ~18 us lower call
# overhead wins (measured equal at 256 x 512).
LARGE_PV_ELEMS = 1 << 17


def dequantize_tiles(x: Tensor, scale: Tensor | None) -> Tensor:
    """fp32 values of KV rows; fp8 codes times their per-token, per-tile fp32 scale (tiles of 128 values for key
    and value, one tile of Dr for key_rope: as many tiles as the scale's last dim holds)."""
    if scale is None:
        return x.float()
    tiles = scale.shape[-1]
    value = fp8_e4m3_to_float(x).unflatten(-1, (tiles, x.shape[-1] // tiles))
    return value.mul_(scale.float().unsqueeze(-1)).flatten(-2)


class Readers(NamedTuple):
    key: KeyReader
    value: KeyReader | None     # None: value is the key tensor, gathered once for both
    rope: KeyReader | None


def same_tensor(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a is b or (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride())


def kv_readers(key: Tensor, value: Tensor, key_rope: Tensor | None, key_scale: Tensor | None,
             value_scale: Tensor | None, block_table: Tensor | None, key_rope_scale: Tensor | None = None) -> Readers:
    """Readers of the KV rows a token selects; fp8 rows (and their scales) are decoded as they are gathered."""
    keys = KeyReader(key, key_scale, block_table, dequantize_tiles, "sfa/key")
    shared = same_tensor(key, value) and same_tensor(key_scale, value_scale)
    values = None if shared else KeyReader(value, value_scale, block_table, dequantize_tiles, "sfa/value")
    rope = None if key_rope is None else KeyReader(key_rope, key_rope_scale, block_table, dequantize_tiles,
                                                   "sfa/rope")
    return Readers(keys, values, rope)


def row_positions(indices: Tensor, block: int, limit: int) -> Tensor:
    """Key positions [P] selected by one row of sparse_indices [K]: each index i >= 0 stands for positions
    i·block .. i·block + block - 1; positions >= limit are dropped. Indices past the last visible block are
    dropped before any product is formed, so no index or block size can overflow int64 or allocate more than
    `limit` positions per index."""
    visible_blocks = -(-limit // block)
    kept = indices[(indices >= 0) & (indices < visible_blocks)]
    if block == 1:
        return kept
    positions = (kept.unsqueeze(1) * block + torch.arange(min(block, limit))).flatten()
    return positions[positions < limit]


def bf16_values(values: Tensor | None, out_dtype: torch.dtype) -> bool:
    """A large P·V may run as a bf16 GEMM (fp32 accumulation): a CPU with native bf16 dot products
    (AVX512-BF16; without them oneDNN emulates bf16 and is slower than fp32), stored bf16 values and a bf16
    output anyway. Measured ~2x fp32 at 2048 x 512 on an AVX512-BF16 EPYC, slower below ~256 x 512."""
    return (onednn_bf16() and values is not None and values.dtype == torch.bfloat16
            and out_dtype == torch.bfloat16)


def _attend_row(readers: Readers, b: int, q: Tensor, q_rope: Tensor | None, positions: Tensor,
                out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Attention of one query token, q [N1,Dl] and q_rope [N1,Dr] fp32 already multiplied by scale_value,
    over the KV rows at `positions`, gathered once: (out [N1,Dl], softmax_max [N1], softmax_sum [N1]).
    The logits and softmax are fp32; with bf16 values and output, the normalized probabilities meet the
    stored bf16 rows in a bf16 GEMM (one extra rounding of each weight, below the output's own)."""
    v_native, k = readers.key.rows(b, positions)
    if readers.value is not None:
        v_native, v = readers.value.rows(b, positions)
    else:
        v = k
    logits = linear(q, k)
    if q_rope is not None:
        logits.addmm_(q_rope, readers.rope.float_rows(b, positions).t())
    row_max = logits.amax(1, keepdim=True)
    probs = logits.sub_(row_max).exp_()
    row_sum = probs.sum(1, keepdim=True)
    if v.numel() < LARGE_PV_ELEMS:
        out = torch.mm(probs, v).div_(row_sum)
    elif bf16_values(v_native, out_dtype):
        out = torch.mm(probs.div(row_sum).to(torch.bfloat16), v_native)
    else:
        out = linear(probs, v.t()).div_(row_sum)  # oneDNN takes the transposed view as is
    return out, row_max.squeeze(1), row_sum.squeeze(1)


def torch_batch(readers: Readers, query: Tensor, query_rope: Tensor | None, indices: Tensor, scale_value: float,
                 b: int, lq: int, lkv: int, sparse_block_size: int, sparse_mode: int,
                 outs: tuple[Tensor, Tensor, Tensor]) -> None:
    """The torch path over the first lq query tokens of batch b, one token at a time, writing into outs."""
    out, softmax_max, softmax_sum = outs
    for t in range(lq):
        positions = row_positions(indices[b, t, 0], sparse_block_size, visible_keys(t, lq, lkv, sparse_mode))
        if positions.numel() == 0:
            continue
        q_rope = None if query_rope is None else query_rope[b, t].float() * scale_value
        o, m, s = _attend_row(readers, b, query[b, t].float() * scale_value, q_rope, positions, query.dtype)
        out[b, t], softmax_max[b, t], softmax_sum[b, t] = o, m, s

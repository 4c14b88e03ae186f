"""The torch path of `ascend_dsa::sparse_flash_attention` for many query tokens (a prefill chunk, a verify step):
a block of query tokens at a time, each token's selected KV rows gathered into one [T, P, D] tensor, the logits of
all tokens and heads one batched GEMM [T, N1, D] @ [T, D, P] (the rope part added by a second one), masked
positions (-1 entries, positions past the visible keys, causal) set to -inf, the softmax in fp32, and the output
one more batched GEMM [T, N1, P] @ [T, P, Dv]. Every masked slot gathers row 0, which its zero weight cancels
(the rows are zeroed first when row 0 holds a NaN or inf, which a zero weight would not cancel). The blocks keep
the gathered rows to about BLOCK_ELEMS fp32 values. The op's definition is in
kernels/sparse_attention/sparse_flash_attention.py; softmax statistics of a token with no visible position are set
by the caller's non-finite rule (its maximum is -inf)."""
import torch
from torch import Tensor

from npu_graph.kernels.sparse_attention import torch_path
from npu_graph.kernels.sparse_attention.torch_path import Readers

# Query tokens from which a batch takes the blocked form (fewer go one token at a time).
BLOCKED_MIN_ROWS = 16
# Gathered fp32 key values per block of query tokens (32 MiB): a few tokens at DeepSeek-V3.2's 2048 x 576.
BLOCK_ELEMS = 1 << 23


def _block_positions(indices: Tensor, block: int, first: int, lq: int, lkv: int, sparse_mode: int
                     ) -> tuple[Tensor, Tensor]:
    """(positions [T, K·block] with masked slots at 0, valid [T, K·block]) for the query tokens first ..
    first+T-1 of a batch, from their rows of sparse_indices [T, K] (int64)."""
    visible_blocks = -(-lkv // block)
    keep = (indices >= 0) & (indices < visible_blocks)
    positions = indices.masked_fill(~keep, 0)           # no product below can overflow
    if block > 1:
        positions = (positions.unsqueeze(-1) * block + torch.arange(block)).flatten(1)
        keep = keep.repeat_interleave(block, 1)
    rows = torch.arange(first, first + indices.shape[0])
    limits = rows.new_full(rows.shape, lkv) if sparse_mode == 0 else (rows + (lkv - lq + 1)).clamp(0, lkv)
    valid = keep & (positions < limits.unsqueeze(1))
    return positions.masked_fill(~valid, 0), valid


def _values(readers: Readers, b: int, flat: Tensor, keys: tuple[Tensor | None, Tensor]
            ) -> tuple[Tensor | None, Tensor]:
    """(stored value rows, fp32 value rows) at the flat positions: the key rows when value is the key tensor."""
    return keys if readers.value is None else readers.value.rows(b, flat)


def _attend_block(readers: Readers, b: int, q: Tensor, q_rope: Tensor | None, positions: Tensor, valid: Tensor,
                  out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Attention of T query tokens q [T,N1,Dl] (fp32, scale_value applied; q_rope likewise) over their positions
    [T,P]: (out [T,N1,Dv], softmax_max [T,N1], softmax_sum [T,N1])."""
    tokens, width = positions.shape
    flat = positions.flatten()
    keys = readers.key.rows(b, flat)
    logits = torch.bmm(q, keys[1].view(tokens, width, -1).transpose(1, 2))
    if q_rope is not None:
        logits.baddbmm_(q_rope, readers.rope.float_rows(b, flat).view(tokens, width, -1).transpose(1, 2))
    logits.masked_fill_(~valid.unsqueeze(1), float("-inf"))
    row_max = logits.amax(2, keepdim=True)
    probs = logits.sub_(row_max).exp_()
    row_sum = probs.sum(2, keepdim=True)
    stored, v = _values(readers, b, flat, keys)
    use_bf16 = v.shape[1] * width >= torch_path.LARGE_PV_ELEMS and torch_path.bf16_values(stored, out_dtype)
    rows = stored if use_bf16 else v
    masked = ~valid.flatten()
    if bool(masked.any()) and not bool(torch.isfinite(rows[int(masked.int().argmax())]).all()):
        rows = rows.masked_fill(masked.unsqueeze(1), 0.0)       # every masked slot holds row 0: 0 · inf is NaN
    rows = rows.view(tokens, width, -1)
    out = (torch.bmm(probs.div_(row_sum).to(torch.bfloat16), rows) if use_bf16
           else torch.bmm(probs, rows).div_(row_sum))
    return out, row_max.squeeze(2), row_sum.squeeze(2)


def blocked_batch(readers: Readers, query: Tensor, query_rope: Tensor | None, indices: Tensor, scale_value: float,
                  b: int, lq: int, lkv: int, sparse_block_size: int, sparse_mode: int,
                  outs: tuple[Tensor, Tensor, Tensor]) -> None:
    """The blocked torch path over the first lq query tokens of batch b (indices: int64), writing into outs."""
    out, softmax_max, softmax_sum = outs
    width = indices.shape[3] * sparse_block_size
    step = max(1, BLOCK_ELEMS // (width * query.shape[3]))
    for first in range(0, lq, step):
        last = min(lq, first + step)
        positions, valid = _block_positions(indices[b, first:last, 0], sparse_block_size, first, lq, lkv,
                                            sparse_mode)
        if not bool(valid.any()):
            continue
        q_rope = None if query_rope is None else query_rope[b, first:last].float() * scale_value
        o, m, s = _attend_block(readers, b, query[b, first:last].float() * scale_value, q_rope, positions, valid,
                                query.dtype)
        out[b, first:last], softmax_max[b, first:last], softmax_sum[b, first:last] = o, m, s

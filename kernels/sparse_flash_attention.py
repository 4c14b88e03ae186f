"""`ascend_dsa::sparse_flash_attention` — DeepSeek-V3.2 sparse attention (DSA) in the MLA absorbed form:
every query token attends only to the key positions the lightning indexer selected for it.

For query token t of batch b and head h, over the selected positions p (see below):

    logit[p] = scale_value · (query[b,t,h] · key[b,p] + query_rope[b,t,h] · key_rope[b,p])
    attention_out[b,t,h] = Σ_p softmax(logit)[p] · value[b,p]             (fp32 arithmetic)
    softmax_max[b,t,h] = max_p logit[p],  softmax_sum[b,t,h] = Σ_p exp(logit[p] − softmax_max)

A query token with no selected position gets attention_out 0, softmax_max -inf and softmax_sum 0.

Argument names, defaults and outputs follow `torch_npu.npu_sparse_flash_attention` as documented for
torch_npu 7.3.0 (Ascend/op-plugin `docs/context/torch_npu-npu_sparse_flash_attention.md`). Differences:
`torch.library.custom_op` does not accept keyword-only Tensor arguments, so the optional tensors
(torch_npu's order, then the fp8 scales this project adds) may also be passed by position, while the other
options stay keyword-only; `pre_tokens`, `next_tokens` and `attention_mode` (torch_npu supports one value of
each; the absorbed form is always used here) and the "TND" layout are not taken; softmax_max/softmax_sum are
always returned, with shape [B,S1,N1] (torch_npu: [B,N2,S1,N1/N2], the same numbers since N2 = 1).

Layouts. query [B,S1,N1,Dl] ("BSND"); key and value [B,S2,1,Dl] ("BSND") or a paged cache
[num_blocks, block_size, 1, Dl] ("PA_BSND") with block_table [B, max_blocks] (int32): token s of batch b is
row s % block_size of block block_table[b, s // block_size]. query_rope [B,S1,N1,Dr] and key_rope (key's
layout, last dim Dr) are optional and go together. value is usually the very tensor passed as key.
actual_seq_lengths_query / actual_seq_lengths_kv: int tensors [B]; default S1 and S2 (paged:
max_blocks·block_size).
Selection. sparse_indices [B,S1,1,K] (int32): entry i >= 0 selects the positions
i·sparse_block_size ... i·sparse_block_size + sparse_block_size − 1; entries -1 are skipped (torch_npu
expects them after the valid ones; here they may be anywhere). Positions >= S2_b are skipped, and with
sparse_mode=3 (causal, bottom-right aligned) so are positions > S2_b − S1_b + t. A position listed twice
counts twice, as on the NPU.
fp8 KV. key/value may be float8_e4m3fn with key_scale/value_scale fp32 of shape [..., Dl/128]: each tile of
128 values of a token is multiplied by its scale. key_rope stays in a float dtype.

Fast CPU path: a native kernel (kernels/native/sparse_attention.c, built at first use by kernels/native.py)
whenever it loads and the KV rows are float (fp32, bf16, fp16) with unit stride along D. One call per batch
covers all its query tokens: the kernel reads sparse_indices (and the block table) itself, reads each selected
row once, and folds a chunk of rows at a time into an online softmax for all heads (fp32; with bf16 query, KV
and output on an AVX512-BF16 CPU, bf16 dot products with fp32 sums: the logits are exact products, and the
probabilities are rounded to bf16 once for the weighted sum, as in the torch path below). Tokens go one per
thread; a decode token's entries are split across the threads and the parts merged. fp8 KV, strided rows, or
no native library (`native.available`, or ASCEND_DSA_NATIVE=0) take the torch path, one query token at a
time: its valid positions are listed, the rows gathered once with index_select straight from the BSND
tensor or the paged cache and converted to fp32 into per-thread scratch buffers (once for key and value when
they are the same tensor), and two GEMMs over all heads do the logits (the rope part as its own small GEMM,
no concatenation; scale_value folded into the query) and the output. The output GEMM takes the stored bf16
rows directly when query and value are bf16, the rows are many (LARGE_PV_ELEMS) and the CPU has native bf16
dot products (AVX512-BF16): the probabilities are normalized in fp32 and rounded to bf16 once.
"""
import ctypes
import functools
from typing import NamedTuple

import torch
from torch import Tensor

from npu_graph.kernels import dispatch, native, native_prototypes
from npu_graph.kernels.checks import (
    require,
    require_choice,
    require_positive,
    require_rank,
    require_same,
    static_checks_needed,
)
from npu_graph.kernels.lightning_indexer import (
    ONEDNN_BF16,
    KeyReader,
    check_dtype,
    check_key_layout,
    check_lengths,
    fp8_e4m3_to_float,
    linear,
    sequence_lengths,
    visible_keys,
)

OP = "sparse_flash_attention"
# Gathered value rows x latent dim from which P·V goes through oneDNN (bf16 where _bf16_values allows, else
# fp32 linear on the transposed view, ~1.5x torch.mm at 2048 rows); below it torch.mm's ~18 us lower call
# overhead wins (measured equal at 256 x 512).
LARGE_PV_ELEMS = 1 << 17
LAYOUTS_QUERY = ("BSND",)
LAYOUTS_KV = ("BSND", "PA_BSND")
SPARSE_MODES = (0, 3)
FP8 = torch.float8_e4m3fn
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KV_DTYPES = (*FLOAT_DTYPES, FP8)
INDEX_DTYPES = (torch.int32, torch.int64)
KV_TILE = 128             # values of a token that share one fp8 scale
NATIVE_SOURCE = "sparse_attention"   # kernels/native/sparse_attention.c
# A query token with at least this many selected entries has them split across the threads (fewer tokens than
# threads); below it the split's barriers cost more than the parallel work saves.
NATIVE_SPLIT_ROWS = 256


def dequantize_tiles(x: Tensor, scale: Tensor | None) -> Tensor:
    """fp32 values of KV rows; fp8 codes times their per-token, per-128-tile fp32 scale."""
    if scale is None:
        return x.float()
    tiles = x.shape[-1] // KV_TILE
    value = fp8_e4m3_to_float(x).unflatten(-1, (tiles, KV_TILE))
    return value.mul_(scale.float().unsqueeze(-1)).flatten(-2)


def _check_kv_scale(x: Tensor, scale: Tensor | None, x_name: str, scale_name: str) -> None:
    if x.dtype != FP8:
        require(scale is None, f"{OP}: `{scale_name}` is only used with a float8_e4m3fn `{x_name}`; "
                               f"`{x_name}` is {x.dtype}")
        return
    require(scale is not None, f"{OP}: float8_e4m3fn `{x_name}` needs `{scale_name}` (fp32, one scale per "
                               f"token and {KV_TILE} values)")
    check_dtype(OP, scale_name, scale, (torch.float32,))
    d = x.shape[-1]
    require(d % KV_TILE == 0, f"{OP}: head dim Dl={d} of float8 `{x_name}` is not a multiple of {KV_TILE}")
    want = (*x.shape[:-1], d // KV_TILE)
    require_same(OP, f"shape of `{scale_name}` and the expected [..., Dl/{KV_TILE}]", tuple(scale.shape), want)


def _check_rope(query: Tensor, key: Tensor, query_rope: Tensor | None, key_rope: Tensor | None) -> None:
    require((query_rope is None) == (key_rope is None),
            f"{OP}: `query_rope` and `key_rope` go together; pass both or neither")
    if query_rope is None:
        return
    for name, t in (("query_rope", query_rope), ("key_rope", key_rope)):
        require_rank(OP, name, t, 4)
        check_dtype(OP, name, t, FLOAT_DTYPES)
    require_same(OP, "leading dims [B,S1,N1] of `query_rope` and `query`", tuple(query_rope.shape[:3]),
                 tuple(query.shape[:3]))
    require_same(OP, "leading dims of `key_rope` and `key`", tuple(key_rope.shape[:3]), tuple(key.shape[:3]))
    require_same(OP, "rope dim Dr of `query_rope` and `key_rope`", query_rope.shape[3], key_rope.shape[3])


def _check_static(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, block_table: Tensor | None,
                  actual_seq_lengths_query: Tensor | None, actual_seq_lengths_kv: Tensor | None,
                  query_rope: Tensor | None, key_rope: Tensor | None, key_scale: Tensor | None,
                  value_scale: Tensor | None, sparse_block_size: int, layout_query: str, layout_kv: str,
                  sparse_mode: int) -> None:
    """Checks on ranks, shapes, dtypes and options: nothing here reads tensor data (safe in the fake)."""
    require_choice(OP, "layout_query", layout_query, LAYOUTS_QUERY)
    require_choice(OP, "layout_kv", layout_kv, LAYOUTS_KV)
    require_choice(OP, "sparse_mode", sparse_mode, SPARSE_MODES)
    require_positive(OP, "sparse_block_size", sparse_block_size)
    for name, t in (("query", query), ("key", key), ("value", value), ("sparse_indices", sparse_indices)):
        require_rank(OP, name, t, 4)
    check_dtype(OP, "query", query, FLOAT_DTYPES)
    check_dtype(OP, "key", key, KV_DTYPES)
    require_same(OP, "dtypes of `value` and `key`", value.dtype, key.dtype)
    check_dtype(OP, "sparse_indices", sparse_indices, INDEX_DTYPES)
    batch, s1 = query.shape[:2]
    require(key.shape[2] == 1, f"{OP}: `key` must have one head (N2=1) in dim 2, got shape {tuple(key.shape)}")
    require_same(OP, "head dim Dl of `query` and `key`", query.shape[3], key.shape[3])
    require(query.shape[3] > 0, f"{OP}: the head dim Dl of `query` and `key` must be > 0, got shape "
                                f"{tuple(query.shape)}")
    require_same(OP, "shapes of `value` and `key`", tuple(value.shape), tuple(key.shape))
    require_same(OP, "leading dims of `sparse_indices` and [B,S1,1]", tuple(sparse_indices.shape[:3]),
                 (batch, s1, 1))
    require(sparse_indices.shape[3] > 0, f"{OP}: `sparse_indices` selects no keys (last dim is 0)")
    _check_rope(query, key, query_rope, key_rope)
    _check_kv_scale(key, key_scale, "key", "key_scale")
    _check_kv_scale(value, value_scale, "value", "value_scale")
    check_key_layout(OP, key, block_table, layout_kv, "layout_kv", batch)
    check_lengths(OP, actual_seq_lengths_query, "actual_seq_lengths_query", batch)
    check_lengths(OP, actual_seq_lengths_kv, "actual_seq_lengths_kv", batch)


def _check_data(sparse_indices: Tensor) -> None:
    if sparse_indices.numel():
        low = int(sparse_indices.min())
        require(low >= -1, f"{OP}: `sparse_indices` holds {low}; entries must be >= 0, or -1 to skip")


def _dense_rows(x: Tensor, scale: Tensor | None, block_table: Tensor | None, b: int, length: int) -> Tensor:
    """The first `length` rows [length, D] of batch b in fp32, read from BSND or through the block table."""
    rows = dequantize_tiles(x, scale)[:, :, 0]
    if block_table is None:
        return rows[b, :length]
    blocks = block_table[b, :-(-length // x.shape[1])].long()
    return rows[blocks].flatten(0, 1)[:length]


def _reference_positions(indices: list[int], block: int, limit: int) -> list[int]:
    return [p for i in indices if 0 <= i * block < limit for p in range(i * block, min((i + 1) * block, limit))]


def reference_sparse_flash_attention(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor,
                                     scale_value: float, block_table: Tensor | None = None,
                                     actual_seq_lengths_query: Tensor | None = None,
                                     actual_seq_lengths_kv: Tensor | None = None, query_rope: Tensor | None = None,
                                     key_rope: Tensor | None = None, key_scale: Tensor | None = None,
                                     value_scale: Tensor | None = None, *, sparse_block_size: int = 1,
                                     layout_query: str = "BSND", layout_kv: str = "BSND", sparse_mode: int = 3,
                                     return_softmax_lse: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The definition, one query token at a time in fp32: list its positions, softmax over their logits."""
    _check_static(query, key, value, sparse_indices, block_table, actual_seq_lengths_query, actual_seq_lengths_kv,
                  query_rope, key_rope, key_scale, value_scale, sparse_block_size, layout_query, layout_kv,
                  sparse_mode)
    _check_data(sparse_indices)
    lq, lkv = sequence_lengths(OP, query, key, block_table, actual_seq_lengths_query, actual_seq_lengths_kv,
                               "actual_seq_lengths_kv")
    out = torch.zeros(query.shape, dtype=torch.float32)
    softmax_max = torch.full(query.shape[:3], float("-inf"), dtype=torch.float32)
    softmax_sum = torch.zeros(query.shape[:3], dtype=torch.float32)
    for b in range(query.shape[0]):
        k = _dense_rows(key, key_scale, block_table, b, lkv[b])
        v = _dense_rows(value, value_scale, block_table, b, lkv[b])
        kr = None if key_rope is None else _dense_rows(key_rope, None, block_table, b, lkv[b])
        for t in range(lq[b]):
            limit = visible_keys(t, lq[b], lkv[b], sparse_mode)
            pos = torch.tensor(_reference_positions(sparse_indices[b, t, 0].tolist(), sparse_block_size, limit),
                               dtype=torch.long)
            if pos.numel() == 0:
                continue
            logits = query[b, t].float() @ k[pos].T
            if kr is not None:
                logits = logits + query_rope[b, t].float() @ kr[pos].T
            logits = logits * scale_value
            row_max = logits.max(-1).values
            e = torch.exp(logits - row_max[:, None])
            out[b, t] = (e @ v[pos]) / e.sum(-1, keepdim=True)
            softmax_max[b, t], softmax_sum[b, t] = row_max, e.sum(-1)
    return out.to(query.dtype), softmax_max, softmax_sum


class _Readers(NamedTuple):
    key: KeyReader
    value: KeyReader | None     # None: value is the key tensor, gathered once for both
    rope: KeyReader | None


def _same_tensor(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a is b or (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride())


def _readers(key: Tensor, value: Tensor, key_rope: Tensor | None, key_scale: Tensor | None,
             value_scale: Tensor | None, block_table: Tensor | None) -> _Readers:
    keys = KeyReader(key, key_scale, block_table, dequantize_tiles, "sfa/key")
    shared = _same_tensor(key, value) and _same_tensor(key_scale, value_scale)
    values = None if shared else KeyReader(value, value_scale, block_table, dequantize_tiles, "sfa/value")
    rope = None if key_rope is None else KeyReader(key_rope, None, block_table, dequantize_tiles, "sfa/rope")
    return _Readers(keys, values, rope)


def _row_positions(indices: Tensor, block: int, limit: int) -> Tensor:
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


def _bf16_values(values: Tensor | None, out_dtype: torch.dtype) -> bool:
    """A large P·V may run as a bf16 GEMM (fp32 accumulation): a CPU with native bf16 dot products
    (AVX512-BF16; without them oneDNN emulates bf16 and is slower than fp32), stored bf16 values and a bf16
    output anyway. Measured ~2x fp32 at 2048 x 512 on an AVX512-BF16 EPYC, slower below ~256 x 512."""
    return (ONEDNN_BF16 and values is not None and values.dtype == torch.bfloat16
            and out_dtype == torch.bfloat16)


def _attend_row(readers: _Readers, b: int, q: Tensor, q_rope: Tensor | None, positions: Tensor,
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
    elif _bf16_values(v_native, out_dtype):
        out = torch.mm(probs.div(row_sum).to(torch.bfloat16), v_native)
    else:
        out = linear(probs, v.t()).div_(row_sum)  # oneDNN takes the transposed view as is
    return out, row_max.squeeze(1), row_sum.squeeze(1)


@functools.cache
def _typed_kernel(lib: ctypes.CDLL) -> tuple[ctypes._CFuncPtr, bool]:
    """(the kernel's entry point with its C signature, whether the build reads fp16)."""
    has_f16 = native_prototypes.typed(lib, NATIVE_SOURCE, "sfa_has_f16")
    return native_prototypes.typed(lib, NATIVE_SOURCE, "sfa_attend"), bool(has_f16())


def _row_major(x: Tensor | None, paged: bool) -> bool:
    """The kernel reads row r of a [B,S2,1,D] tensor at x[b].data_ptr() + r·stride(1) and of a paged cache at
    x.data_ptr() + r·stride(1): D contiguous, and a cache's blocks one after another."""
    if x is None:
        return True
    return x.device.type == "cpu" and x.stride(3) == 1 and (not paged or x.stride(0) == x.shape[1] * x.stride(1))


def _native_kernel(key: Tensor, value: Tensor, key_rope: Tensor | None,
                   block_table: Tensor | None) -> ctypes._CFuncPtr | None:
    """The native kernel when it is loaded and reads these KV tensors (module docstring), else None."""
    loaded = native.load(NATIVE_SOURCE)
    codes = native.DTYPE_CODES
    if not loaded or key.dtype not in codes or (key_rope is not None and key_rope.dtype not in codes):
        return None
    fn, has_f16 = _typed_kernel(loaded.lib)
    if torch.float16 in (key.dtype, None if key_rope is None else key_rope.dtype) and not has_f16:
        return None
    paged = block_table is not None
    return fn if all(_row_major(x, paged) for x in (key, value, key_rope)) else None


def _rows_base(x: Tensor | None, b: int, paged: bool) -> tuple[int | None, int]:
    if x is None:
        return None, 0
    return (x.data_ptr() if paged else x[b].data_ptr()), x.stride(1)


def _native_batch(kernel: ctypes._CFuncPtr, args: tuple, b: int, lq: int, lkv: int,
                  outs: tuple[Tensor, Tensor, Tensor]) -> bool:
    """Runs the kernel over the first lq query tokens of batch b, writing into outs; False when the kernel
    could not allocate its scratch memory (the caller then takes the torch path). indices and table are int64
    and contiguous."""
    (query, key, value, indices, scale, table, query_rope, key_rope, block, mode) = args
    out, softmax_max, softmax_sum = outs
    paged = table is not None
    q = query[b, :lq].float().contiguous()
    q_rope = None if query_rope is None else query_rope[b, :lq].float().contiguous()
    bf16_dot = query.dtype == torch.bfloat16 and (query_rope is None or query_rope.dtype == torch.bfloat16)
    direct = out.dtype == torch.float32        # the kernel writes fp32: into the output itself
    target = out[b] if direct else torch.empty(q.shape, dtype=torch.float32, device="cpu")
    kv, kv_stride = _rows_base(key, b, paged)
    v, v_stride = _rows_base(None if _same_tensor(key, value) else value, b, paged)
    rope, rope_stride = _rows_base(key_rope, b, paged)
    n1, dl = q.shape[1:]
    ok = kernel(q.data_ptr(), None if q_rope is None else q_rope.data_ptr(), n1, dl,
                0 if q_rope is None else q_rope.shape[2], indices[b].data_ptr(), indices.stride(1),
                indices.shape[3], block, lq, lkv, mode == 3, table[b].data_ptr() if paged else None, key.shape[1],
                kv, kv_stride, v, v_stride, rope, rope_stride, native.DTYPE_CODES[key.dtype],
                native.DTYPE_CODES[key.dtype if key_rope is None else key_rope.dtype], scale, bf16_dot,
                torch.get_num_threads(), NATIVE_SPLIT_ROWS, target.data_ptr(), softmax_max[b].data_ptr(),
                softmax_sum[b].data_ptr())
    if not direct:
        out[b, :lq] = target
    return bool(ok)


def _rows_read(indices: Tensor, block: int, lq: int, lkv: int) -> int:
    """KV rows the first lq query tokens of a batch read in all, at most (each up to K·block of lkv)."""
    return lq * min(indices.shape[3] * block, lkv)


def _native_dequantized(readers: _Readers, args: tuple, b: int, lq: int, lkv: int,
                        outs: tuple[Tensor, Tensor, Tensor]) -> bool:
    """KV the kernel cannot read as stored (scaled fp8) whose rows the query tokens read at least once over in
    all (a prefill; a decode step over a short cache): batch b's visible rows dequantized once into fp32, then
    the native kernel over them. False when no native kernel reads them (the caller takes the torch path)."""
    keys = readers.key.float_range(b, 0, lkv)[None, :, None]
    values = keys if readers.value is None else readers.value.float_range(b, 0, lkv)[None, :, None]
    rope = None if readers.rope is None else readers.rope.float_range(b, 0, lkv)[None, :, None]
    kernel = _native_kernel(keys, values, rope, None)
    if kernel is None:
        return False
    query, _, _, indices, scale, _, query_rope, _, block, mode = args
    rows = (query[b:b + 1], keys, values, indices[b:b + 1], scale, None,
            None if query_rope is None else query_rope[b:b + 1], rope, block, mode)
    return _native_batch(kernel, rows, 0, lq, lkv, tuple(out[b:b + 1] for out in outs))


def _torch_batch(readers: _Readers, query: Tensor, query_rope: Tensor | None, indices: Tensor, scale_value: float,
                 b: int, lq: int, lkv: int, sparse_block_size: int, sparse_mode: int,
                 outs: tuple[Tensor, Tensor, Tensor]) -> None:
    """The torch path over the first lq query tokens of batch b, one token at a time, writing into outs."""
    out, softmax_max, softmax_sum = outs
    for t in range(lq):
        positions = _row_positions(indices[b, t, 0], sparse_block_size, visible_keys(t, lq, lkv, sparse_mode))
        if positions.numel() == 0:
            continue
        q_rope = None if query_rope is None else query_rope[b, t].float() * scale_value
        o, m, s = _attend_row(readers, b, query[b, t].float() * scale_value, q_rope, positions, query.dtype)
        out[b, t], softmax_max[b, t], softmax_sum[b, t] = o, m, s


def _sparse_flash_attention_cpu(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor,
                                scale_value: float, block_table: Tensor | None,
                                actual_seq_lengths_query: Tensor | None, actual_seq_lengths_kv: Tensor | None,
                                query_rope: Tensor | None, key_rope: Tensor | None, key_scale: Tensor | None,
                                value_scale: Tensor | None, sparse_block_size: int,
                                sparse_mode: int) -> tuple[Tensor, Tensor, Tensor]:
    _check_data(sparse_indices)
    lq, lkv = sequence_lengths(OP, query, key, block_table, actual_seq_lengths_query, actual_seq_lengths_kv,
                               "actual_seq_lengths_kv")
    outs = (torch.zeros(query.shape, dtype=query.dtype, device=query.device),
            torch.full(query.shape[:3], float("-inf"), dtype=torch.float32, device=query.device),
            torch.zeros(query.shape[:3], dtype=torch.float32, device=query.device))
    indices = sparse_indices.long().contiguous()
    kernel = _native_kernel(key, value, key_rope, block_table)
    table = None if block_table is None else block_table.long().contiguous()
    args = (query, key, value, indices, scale_value, table, query_rope, key_rope, sparse_block_size, sparse_mode)
    readers = None
    for b in range(query.shape[0]):
        if lq[b] == 0 or (kernel is not None and _native_batch(kernel, args, b, lq[b], lkv[b], outs)):
            continue
        readers = readers or _readers(key, value, key_rope, key_scale, value_scale, block_table)
        if _rows_read(indices, sparse_block_size, lq[b], lkv[b]) >= lkv[b] and \
                _native_dequantized(readers, args, b, lq[b], lkv[b], outs):
            continue
        _torch_batch(readers, query, query_rope, indices, scale_value, b, lq[b], lkv[b], sparse_block_size,
                     sparse_mode, outs)
    return outs


@torch.library.custom_op("ascend_dsa::sparse_flash_attention", mutates_args=())
def sparse_flash_attention(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float,
                           block_table: Tensor | None = None, actual_seq_lengths_query: Tensor | None = None,
                           actual_seq_lengths_kv: Tensor | None = None, query_rope: Tensor | None = None,
                           key_rope: Tensor | None = None, key_scale: Tensor | None = None,
                           value_scale: Tensor | None = None, *, sparse_block_size: int = 1,
                           layout_query: str = "BSND", layout_kv: str = "BSND", sparse_mode: int = 3,
                           return_softmax_lse: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Attention over the selected KV rows; see the module docstring. Returns (attention_out [B,S1,N1,Dl]
    in query's dtype, softmax_max fp32 [B,S1,N1], softmax_sum fp32 [B,S1,N1])."""
    if static_checks_needed():
        _check_static(query, key, value, sparse_indices, block_table, actual_seq_lengths_query,
                      actual_seq_lengths_kv, query_rope, key_rope, key_scale, value_scale, sparse_block_size,
                      layout_query, layout_kv, sparse_mode)
    def run() -> tuple[Tensor, Tensor, Tensor]:
        return _sparse_flash_attention_cpu(query, key, value, sparse_indices, scale_value, block_table,
                                           actual_seq_lengths_query, actual_seq_lengths_kv, query_rope, key_rope,
                                           key_scale, value_scale, sparse_block_size, sparse_mode)

    cls = native_class(query, key, value, sparse_indices, scale_value, block_table, query_rope=query_rope,
                       key_rope=key_rope, sparse_block_size=sparse_block_size)
    return run() if cls is None else dispatch.run(OP, NATIVE_SOURCE, cls, run, dispatch.torch_path(run))


def native_class(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, *args: object,
                 query_rope: Tensor | None = None, key_rope: Tensor | None = None, sparse_block_size: int = 1,
                 **kwargs: object) -> tuple | None:
    """The shape class kernels/dispatch.py measures for a call the native kernel takes, else None."""
    block_table = args[1] if len(args) > 1 else kwargs.get("block_table")
    if _native_kernel(key, value, key_rope, block_table) is None:
        return None
    rope = 0 if query_rope is None else query_rope.shape[3]
    return dispatch.shape_class(query.dtype, key.dtype, block_table is not None, *query.shape[1:], rope,
                                sparse_indices.shape[3] * min(sparse_block_size, key.shape[1]))


@sparse_flash_attention.register_fake
def _sparse_flash_attention_fake(query, key, value, sparse_indices, scale_value, block_table=None,
                                 actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                                 key_rope=None, key_scale=None, value_scale=None, *, sparse_block_size=1,
                                 layout_query="BSND", layout_kv="BSND", sparse_mode=3, return_softmax_lse=False):
    _check_static(query, key, value, sparse_indices, block_table, actual_seq_lengths_query, actual_seq_lengths_kv,
                  query_rope, key_rope, key_scale, value_scale, sparse_block_size, layout_query, layout_kv,
                  sparse_mode)
    batch, s1, n1 = query.shape[:3]
    stats = query.new_empty((batch, s1, n1), dtype=torch.float32)
    return query.new_empty(query.shape), stats, torch.empty_like(stats)     # contiguous, as the CPU path returns

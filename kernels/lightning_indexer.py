"""`ascend_dsa::lightning_indexer` — the DeepSeek-V3.2 sparse-attention (DSA) indexer: for every query
token, the `sparse_count` key positions with the highest index score

    score[b,t,s] = Σ_j weights[b,t,j] · ReLU(query[b,t,j,:] · key[b,s,:])        (fp32 arithmetic)

Argument names, defaults and outputs follow `torch_npu.npu_lightning_indexer` as documented for torch_npu
7.3.0 (Ascend/op-plugin `docs/context/torch_npu-npu_lightning_indexer.md`), so that the NPU target maps the
call one to one. Differences: `torch.library.custom_op` does not accept keyword-only Tensor arguments, so
the optional tensors (torch_npu's order, then the MXFP8 scales this project adds) may also be passed by
position, while the other options stay keyword-only; `pre_tokens`/`next_tokens` (torch_npu supports only
their defaults) and the "TND" layout are not taken; `sparse_values` is fp32 and always returned
(`return_value` only records that the caller wants it).

Layouts. query [B,S1,N1,D] ("BSND"); weights [B,S1,N1]; key [B,S2,1,D] ("BSND") or a paged cache
[num_blocks, block_size, 1, D] ("PA_BSND") with block_table [B, max_blocks] (int32): token s of batch b is
row s % block_size of block block_table[b, s // block_size].
actual_seq_lengths_query / actual_seq_lengths_key: int tensors [B]; default S1 and S2 (paged:
max_blocks·block_size). Query rows t >= actual_seq_lengths_query[b] get no keys.
Visibility. sparse_mode=0: query t of batch b sees keys s < S2_b. sparse_mode=3 (causal, aligned at the
bottom right): it sees keys s <= S2_b − S1_b + t, with S1_b, S2_b the actual lengths.
Outputs. sparse_indices int32 [B,S1,1,sparse_count]: visible key positions by descending score, padded with
-1 when fewer than sparse_count keys are visible; sparse_values fp32, same shape: the scores, -inf on pads.
MXFP8. query/key may be float8_e4m3fn with query_scale/key_scale of shape [..., D/32] (float8_e8m0fnu, or
uint8 holding the biased exponent e): each group of 32 values along D is multiplied by 2^(e − 127).

Fast CPU path. Query rows are processed in blocks; the keys of a batch stream through in chunks (as many
keys as keep the chunk's [keys, rows·N1] scores within SCORE_BUDGET elements) that are converted (or
dequantized) to fp32, scored by one GEMM [chunk, D] @ [D, rows·N1] with the ReLU fused and a matvec with the
weights per row, and merged into a running top-K: score memory is bounded by SCORE_BUDGET whatever the
context length (a decode row's 16 heads × 16K keys fit in one chunk; a prefill block's do not).
Decode rows (at most PREFILTER_MAX_ROWS valid query rows in a batch) of fp32/bf16/fp16 inputs are scored by a
native kernel when it is built (kernels/lightning_indexer_native.py): the fp32 score of every visible key read
straight from the stored keys, then one top-K. Without it, such rows (bf16 query and keys, more than 2K visible
keys) on a CPU with native bf16 dot products (AVX512-BF16: there a bf16 GEMM is ~2x an fp32 one; elsewhere it is
emulated) take a prefilter instead: one bf16 GEMM over all keys (fp32 accumulation, each dot product q_j·k rounded
once to bf16, unit roundoff u = 2^-8) and a small one over its ReLU give every key an approximate score A and Bnd
= Σ_j |w_j|·ReLU(q_j·k). Those roundings (and the weights', when they are not bf16 already) move A by at most
2u·Bnd (3u·Bnd) from the fp32 score, so e = 2.1u·Bnd (3.1u·Bnd) bounds the error. τ, a value at or below the K-th
largest A − e (read off a sample and checked by a count), is reached by at least K true scores, so every key with
A + e < τ is out of the top K. The candidates left (K plus those within the margins) are gathered and scored in
fp32, and the top K among them is exactly the top K of the definition, values included.
Large temporaries (gathered rows, fp32 copies) live in per-thread scratch buffers reused across calls.
"""
import math
import threading
from collections.abc import Callable

import torch
from torch import Tensor

from npu_graph.kernels import dispatch, lightning_indexer_native
from npu_graph.kernels.checks import (
    require,
    require_choice,
    require_dtype,
    require_positive,
    require_rank,
    require_same,
    static_checks_needed,
)

OP = "lightning_indexer"
LAYOUTS_QUERY = ("BSND",)
LAYOUTS_KEY = ("BSND", "PA_BSND")
SPARSE_MODES = (0, 3)
MX_GROUP = 32
FP8 = torch.float8_e4m3fn
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
INDEX_DTYPES = (torch.int32, torch.int64)
INT32_MAX = 2 ** 31 - 1     # the largest position the int32 `sparse_indices` hold
KEY_CHUNK = 4096          # fewest keys per fp32 GEMM in the streamed path
SCORE_BUDGET = 1 << 21    # elements of one [chunk, rows·N1] GEMM output: chunks grow to it (decode: few rows)
PREFILTER_CHUNK = 16384   # keys per bf16 GEMM in the prefilter
PREFILTER_MAX_ROWS = 8    # a batch with more valid query rows uses the streamed path
MARGIN_BF16_WEIGHTS = 2.1 * 2.0 ** -8     # e / Σ|w|·ReLU(q·k): 2u (+ slack) for bf16 u = 2^-8, see docstring
MARGIN_ROUNDED_WEIGHTS = 3.1 * 2.0 ** -8  # 3u (+ slack) when the weights are rounded to bf16 as well
ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
ONEDNN_BF16 = ONEDNN_LINEAR and torch.cpu._is_avx512_bf16_supported()
BF16_PREFILTER = ONEDNN_BF16   # decode rows of bf16 inputs take the bf16 prefilter (module docstring)
_SCRATCH = threading.local()
_E4M3_F16_MASK = -16512   # int16 0xBF80: sign and the 7 magnitude bits of an e4m3 byte shifted left by 7


def check_dtype(op: str, name: str, t: Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """require_dtype that formats its message only on failure: str(dtype) costs microseconds, and an op
    checks several dtypes per call."""
    if t.dtype not in dtypes:
        require_dtype(op, name, t, dtypes)


def _check_scale(x: Tensor, scale: Tensor | None, x_name: str, scale_name: str) -> None:
    if x.dtype != FP8:
        require(scale is None, f"{OP}: `{scale_name}` is only used with a float8_e4m3fn `{x_name}`; "
                               f"`{x_name}` is {x.dtype}")
        return
    require(scale is not None, f"{OP}: float8_e4m3fn `{x_name}` needs `{scale_name}` (MXFP8, one e8m0 "
                               f"scale per {MX_GROUP} values along D)")
    check_dtype(OP, scale_name, scale, SCALE_DTYPES)
    d = x.shape[-1]
    require(d % MX_GROUP == 0, f"{OP}: head dim D={d} of float8 `{x_name}` is not a multiple of {MX_GROUP}")
    want = (*x.shape[:-1], d // MX_GROUP)
    require_same(OP, f"shape of `{scale_name}` and the expected [..., D/{MX_GROUP}]", tuple(scale.shape), want)


def check_lengths(op: str, lengths: Tensor | None, name: str, batch: int) -> None:
    if lengths is not None:
        require_rank(op, name, lengths, 1)
        check_dtype(op, name, lengths, INDEX_DTYPES)
        require_same(op, f"length of `{name}` and the batch size B", lengths.shape[0], batch)


def check_key_layout(op: str, key: Tensor, block_table: Tensor | None, layout: str, layout_name: str,
                     batch: int) -> None:
    """A BSND key has the query's batch size and no block table; a paged one needs a [B, max_blocks] table."""
    if layout == "BSND":
        require(block_table is None, f"{op}: `block_table` is only used with {layout_name}='PA_BSND'")
        require_same(op, "batch size of `key` and `query`", key.shape[0], batch)
        return
    require(block_table is not None, f"{op}: {layout_name}='PA_BSND' needs `block_table` [B, max_blocks]")
    require_rank(op, "block_table", block_table, 2)
    check_dtype(op, "block_table", block_table, INDEX_DTYPES)
    require_same(op, "rows of `block_table` and the batch size B", block_table.shape[0], batch)


def _check_static(query: Tensor, key: Tensor, weights: Tensor, actual_seq_lengths_query: Tensor | None,
                  actual_seq_lengths_key: Tensor | None, block_table: Tensor | None, query_scale: Tensor | None,
                  key_scale: Tensor | None, layout_query: str, layout_key: str, sparse_count: int,
                  sparse_mode: int) -> None:
    """Checks on ranks, shapes, dtypes and options: nothing here reads tensor data (safe in the fake)."""
    require_choice(OP, "layout_query", layout_query, LAYOUTS_QUERY)
    require_choice(OP, "layout_key", layout_key, LAYOUTS_KEY)
    require_choice(OP, "sparse_mode", sparse_mode, SPARSE_MODES)
    require_positive(OP, "sparse_count", sparse_count)
    for name, t, rank in (("query", query, 4), ("key", key, 4), ("weights", weights, 3)):
        require_rank(OP, name, t, rank)
    check_dtype(OP, "query", query, INPUT_DTYPES)
    check_dtype(OP, "key", key, INPUT_DTYPES)
    check_dtype(OP, "weights", weights, WEIGHT_DTYPES)
    batch, s1, n1, d = query.shape
    require(key.shape[2] == 1, f"{OP}: `key` must have one head (N2=1) in dim 2, got shape {tuple(key.shape)}")
    require_same(OP, "head dim D of `query` and `key`", d, key.shape[3])
    require(n1 > 0 and d > 0, f"{OP}: `query` needs at least one head and a head dim > 0, got shape "
                              f"{tuple(query.shape)} [B,S1,N1,D]")
    positions = key.shape[1] if block_table is None else block_table.shape[1] * key.shape[1]
    require(positions <= INT32_MAX, f"{OP}: `key` holds {positions} positions; the int32 `sparse_indices` it "
                                    f"returns address at most {INT32_MAX}")
    require_same(OP, "shape of `weights` and [B,S1,N1] of `query`", tuple(weights.shape), (batch, s1, n1))
    _check_scale(query, query_scale, "query", "query_scale")
    _check_scale(key, key_scale, "key", "key_scale")
    check_key_layout(OP, key, block_table, layout_key, "layout_key", batch)
    check_lengths(OP, actual_seq_lengths_query, "actual_seq_lengths_query", batch)
    check_lengths(OP, actual_seq_lengths_key, "actual_seq_lengths_key", batch)


def _lengths(op: str, lengths: Tensor | None, default: int, name: str) -> list[int]:
    if lengths is None:
        return []
    values = [int(v) for v in lengths.tolist()]
    for b, v in enumerate(values):
        require(0 <= v <= default, f"{op}: `{name}`[{b}]={v} is outside [0, {default}]")
    return values


def _check_block_table(op: str, block_table: Tensor, block_size: int, num_blocks: int,
                       key_lengths: list[int]) -> None:
    """Every block that holds one of the first actual_seq_lengths_key[b] tokens must exist in the cache."""
    for b, length in enumerate(key_lengths):
        used = block_table[b, :math.ceil(length / block_size)]
        if used.numel():
            low, high = int(used.min()), int(used.max())
            require(low >= 0 and high < num_blocks,
                    f"{op}: `block_table`[{b}] refers to block {low if low < 0 else high}, outside the "
                    f"{num_blocks} blocks of the paged `key`")


def sequence_lengths(op: str, query: Tensor, key: Tensor, block_table: Tensor | None, query_lengths: Tensor | None,
                     key_lengths: Tensor | None, key_lengths_name: str) -> tuple[list[int], list[int]]:
    """Actual query and key lengths per batch as Python ints (defaults filled in), range-checked, and the
    block table checked against them."""
    batch, s1 = query.shape[:2]
    capacity = key.shape[1] if block_table is None else block_table.shape[1] * key.shape[1]
    lq = _lengths(op, query_lengths, s1, "actual_seq_lengths_query") or [s1] * batch
    lk = _lengths(op, key_lengths, capacity, key_lengths_name) or [capacity] * batch
    if block_table is not None:
        _check_block_table(op, block_table, key.shape[1], key.shape[0], lk)
    return lq, lk


def visible_keys(row: int, query_len: int, key_len: int, sparse_mode: int) -> int:
    """Number of leading key positions query row `row` may attend to."""
    if sparse_mode == 0:
        return key_len
    return min(max(key_len - query_len + row + 1, 0), key_len)


def fp8_e4m3_to_float(codes: Tensor) -> Tensor:
    """Exact fp32 values of float8_e4m3fn codes. An e4m3 byte shifted 7 bits up is a float16 with the same
    bits of mantissa and an exponent 8 too small; NaN codes (0x7F, 0xFF) are patched afterwards."""
    half = (codes.view(torch.int8).to(torch.int16) << 7).bitwise_and_(_E4M3_F16_MASK).view(torch.float16)
    value = half.float().mul_(256.0)
    nan = codes.view(torch.uint8).bitwise_and(0x7F) == 0x7F
    return value.masked_fill_(nan, float("nan"))


def e8m0_to_float(scale: Tensor) -> Tensor:
    """2^(e − 127) for the biased exponents e of an e8m0 (or uint8) scale; e = 255 is NaN."""
    return scale.view(torch.float8_e8m0fnu).float()


def dequantize(x: Tensor, scale: Tensor | None) -> Tensor:
    """fp32 values of x; MXFP8 codes are multiplied by their per-32 group scale."""
    if scale is None:
        return x.float()
    groups = x.shape[-1] // MX_GROUP
    value = fp8_e4m3_to_float(x).unflatten(-1, (groups, MX_GROUP))
    return value.mul_(e8m0_to_float(scale).unsqueeze(-1)).flatten(-2)


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A buffer of this thread reused from call to call, for multi-megabyte temporaries: a fresh allocation of
    that size is handed back to the OS when freed, so every call would page-fault it in again, which costs as
    much as the work done in it. Allocated as a normal tensor even under inference mode, so that later calls
    outside it may write to it. Nothing built on a scratch buffer is returned to the caller."""
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    numel = math.prod(shape)
    buf = buffers.get((name, dtype))
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):
            buf = buffers[(name, dtype)] = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(shape)


def _as_float(x: Tensor, name: str) -> Tensor:
    """x in fp32: x itself, or a copy in the scratch buffer `name`."""
    return x if x.dtype == torch.float32 else scratch(name, tuple(x.shape), torch.float32).copy_(x)


def linear(x: Tensor, w: Tensor, relu: bool = False) -> Tensor:
    """x @ w.T, optionally through a ReLU that keeps NaN (module docstring), with fp32 accumulation. oneDNN's linear
    is used where it is available (faster than the default GEMM for these skinny shapes on CPU, and bf16 inputs
    only round the result); otherwise torch.nn.functional.linear."""
    if ONEDNN_LINEAR and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and ONEDNN_BF16)):
        out = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    else:
        out = torch.nn.functional.linear(x, w)
    return out.relu_() if relu else out     # not oneDNN's fused ReLU, which turns NaN into 0 (torch.relu keeps it)


class KeyReader:
    """Key rows of one batch, by range or by position, from a BSND tensor [B,S2,1,D] or through the block
    table of a paged cache [num_blocks, block_size, 1, D]; only the rows asked for are copied, into scratch
    buffers named after `name`. `dequant` turns stored rows and their scale rows into fp32."""

    def __init__(self, key: Tensor, key_scale: Tensor | None, block_table: Tensor | None,
                 dequant: Callable[[Tensor, Tensor | None], Tensor] = dequantize, name: str = "key") -> None:
        self.key = key.select(2, 0)
        self.scale = None if key_scale is None else key_scale.select(2, 0)
        self.table = None if block_table is None else block_table.long()
        self.block = key.shape[1]
        self.dequant = dequant
        self.name = name

    def _range(self, t: Tensor, b: int, start: int, end: int) -> Tensor:
        if self.table is None:
            return t[b, start:end]
        first, last = start // self.block, -(-end // self.block)
        blocks = self.table[b, first:last]
        lo = int(blocks[0])
        if int(blocks[-1]) - lo == len(blocks) - 1 and bool((blocks.diff() == 1).all()):
            rows = t[lo:lo + len(blocks)].flatten(0, 1)  # consecutive blocks: a view, no copy
        else:
            rows = t.index_select(0, blocks).flatten(0, 1)
        offset = start - first * self.block
        return rows[offset:offset + end - start]

    def _rows(self, t: Tensor, b: int, positions: Tensor, out: Tensor | None = None) -> Tensor:
        if self.table is None:
            source, slots = t[b], positions
        else:
            source = t.flatten(0, 1)
            slots = self.table[b, positions // self.block] * self.block + positions % self.block
        return source.index_select(0, slots) if out is None else torch.index_select(source, 0, slots, out=out)

    def native_range(self, b: int, start: int, end: int) -> Tensor:
        return self._range(self.key, b, start, end)

    def float_range(self, b: int, start: int, end: int) -> Tensor:
        native = self.native_range(b, start, end)
        if self.scale is not None:
            return self.dequant(native, self._range(self.scale, b, start, end))
        return _as_float(native, self.name + "/range")

    def rows(self, b: int, positions: Tensor) -> tuple[Tensor | None, Tensor]:
        """(the stored rows at `positions`, or None for scaled fp8 rows; the same rows in fp32)."""
        if self.scale is not None:
            return None, self.dequant(self._rows(self.key, b, positions), self._rows(self.scale, b, positions))
        shape = (positions.numel(), self.key.shape[-1])
        native = self._rows(self.key, b, positions, out=scratch(self.name + "/rows", shape, self.key.dtype))
        return native, _as_float(native, self.name + "/rows_f32")

    def float_rows(self, b: int, positions: Tensor) -> Tensor:
        return self.rows(b, positions)[1]


def _pad_topk(scores: Tensor, positions: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k of scores [R, n] along the last dim, sorted, as (positions int32, values); -1/-inf pads when
    fewer than k entries are finite (masked keys carry -inf)."""
    rows, n = scores.shape
    indices = torch.full((rows, k), -1, dtype=torch.int32)
    values = torch.full((rows, k), float("-inf"), dtype=torch.float32)
    top, where = scores.topk(min(k, n), dim=-1)
    chosen = positions.expand(rows, n).gather(1, where)
    values[:, :top.shape[1]] = top
    indices[:, :top.shape[1]] = chosen.masked_fill(top == float("-inf"), -1).to(torch.int32)
    return indices, values


def reference_lightning_indexer(query: Tensor, key: Tensor, weights: Tensor,
                                actual_seq_lengths_query: Tensor | None = None,
                                actual_seq_lengths_key: Tensor | None = None, block_table: Tensor | None = None,
                                query_scale: Tensor | None = None, key_scale: Tensor | None = None, *,
                                layout_query: str = "BSND", layout_key: str = "BSND", sparse_count: int = 2048,
                                sparse_mode: int = 3, return_value: bool = False) -> tuple[Tensor, Tensor]:
    """The definition, one query row at a time in fp32: score all visible keys, keep the top K."""
    _check_static(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
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


def _chunk_scores(keys_f32: Tensor, q_rows: Tensor, w_rows: Tensor) -> Tensor:
    """Scores [R, n] of keys [n, D] for query rows [R, N1, D] with weights [R, N1], all fp32: one GEMM over
    all rows and heads, ReLU in place, then a matvec over the heads (batched over the rows)."""
    rows, n1, d = q_rows.shape
    relu = linear(keys_f32, q_rows.reshape(rows * n1, d), relu=True)
    if rows == 1:
        return torch.mv(relu, w_rows[0]).unsqueeze(0)
    per_row = relu.view(-1, rows, n1).transpose(0, 1)
    return torch.bmm(per_row, w_rows.unsqueeze(-1)).squeeze(-1)


def _merge_topk(best: Tensor, best_pos: Tensor, scores: Tensor, pos: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Running top-k: keep the k largest of the kept entries and a new chunk (positions [R, n] / [n])."""
    merged = torch.cat([best, scores], 1)
    merged_pos = torch.cat([best_pos, pos.expand(scores.shape)], 1)
    top, where = merged.topk(min(k, merged.shape[1]), dim=1, sorted=False)
    return top, merged_pos.gather(1, where)


def _streamed_topk(keys: KeyReader, b: int, q_rows: Tensor, w_rows: Tensor, limits: list[int],
                   k: int) -> tuple[Tensor, Tensor]:
    """Exact top-k for a block of query rows: key chunks in fp32 through `_chunk_scores`, invisible keys
    masked to -inf, merged into a running top-k."""
    rows, n1 = q_rows.shape[:2]
    limit = torch.tensor(limits).unsqueeze(1)
    best, best_pos = torch.empty(rows, 0, dtype=torch.float32), torch.empty(rows, 0, dtype=torch.long)
    chunk = max(KEY_CHUNK, SCORE_BUDGET // (rows * n1))
    for start in range(0, max(limits), chunk):
        end = min(start + chunk, max(limits))
        scores = _chunk_scores(keys.float_range(b, start, end), q_rows, w_rows)
        pos = torch.arange(start, end)
        scores.masked_fill_(pos >= limit, float("-inf"))
        best, best_pos = _merge_topk(best, best_pos, scores, pos, k)
    return _pad_topk(best, best_pos, k)


def _approx_scores(keys: KeyReader, b: int, q_row: Tensor, w_row: Tensor, limit: int) -> tuple[Tensor, Tensor]:
    """bf16 GEMMs with fp32 accumulation: approximate scores A [limit] and their error margin e [limit], both
    fp32 (module docstring)."""
    mix = torch.stack([w_row, w_row.abs()]).to(torch.bfloat16)
    parts = []
    for start in range(0, limit, PREFILTER_CHUNK):
        relu = linear(keys.native_range(b, start, min(start + PREFILTER_CHUNK, limit)), q_row, relu=True)
        parts.append(torch.mm(mix, relu.t()))
    both = (parts[0] if len(parts) == 1 else torch.cat(parts, 1)).float()
    exact_weights = torch.equal(mix[0].float(), w_row)
    return both[0], both[1].mul_(MARGIN_BF16_WEIGHTS if exact_weights else MARGIN_ROUNDED_WEIGHTS)


def _kth_largest_bound(x: Tensor, k: int) -> Tensor:
    """A value v with at least k entries of x >= v, close to the k-th largest entry: read off a strided 1/8
    sample, aimed 2.5 standard deviations low, and checked on the whole; else the exact k-th largest entry
    (a full selection costs more than the few extra candidates the estimate lets through)."""
    n = x.numel()
    if k >= 512:
        sample = x[::8].contiguous()
        m = sample.numel()
        expected = k * m / n
        rank = min(round(expected + 2.5 * math.sqrt(expected)), m)
        v = torch.kthvalue(sample, m - rank + 1).values
        if int((x >= v).sum()) >= k:
            return v
    return torch.kthvalue(x, n - k + 1).values


def _prefiltered_topk(keys: KeyReader, b: int, q_row: Tensor, w_row: Tensor, limit: int,
                      k: int) -> tuple[Tensor, Tensor]:
    """Top-k of one bf16 query row (module docstring): at least k true scores reach τ, a value at or below
    the k-th largest lower bound A − e, so keys with A + e < τ are pruned; the rest are scored in fp32."""
    approx, margin = _approx_scores(keys, b, q_row, w_row, limit)
    tau = _kth_largest_bound(approx - margin, k)
    upper = approx.add_(margin)
    candidates = torch.nonzero((upper >= tau) | upper.isnan()).squeeze(1)       # a NaN score ranks first
    exact = _chunk_scores(keys.float_rows(b, candidates), q_row.float().unsqueeze(0), w_row.unsqueeze(0))[0]
    top, where = exact.topk(k)
    positions = candidates[where].masked_fill(top == float("-inf"), -1)        # -inf counts as masked
    return positions.to(torch.int32).unsqueeze(0), top.unsqueeze(0)


def _batch_topk(keys: KeyReader, b: int, query: Tensor, query_scale: Tensor | None, w: Tensor,
                limits: list[int], k: int, prefilter: bool,
                top_row: Callable[..., tuple[Tensor, Tensor]] | None) -> list[tuple[int, int, Tensor, Tensor]]:
    """(first row, last row, indices, values) blocks covering the valid query rows of batch b."""
    n1 = query.shape[2]
    per_row = len(limits) <= PREFILTER_MAX_ROWS
    if per_row and (prefilter or top_row is not None):
        blocks = [(t, t + 1) for t in range(len(limits))]
    else:
        step = max(1, SCORE_BUDGET // (KEY_CHUNK * n1))
        blocks = [(t, min(t + step, len(limits))) for t in range(0, len(limits), step)]
    out = []
    for t0, t1 in blocks:
        if max(limits[t0:t1]) == 0:
            continue
        if top_row is not None and per_row:
            out.append((t0, t1, *top_row(b, limits[t0], query[b, t0], w[b, t0])))
            continue
        if prefilter and t1 - t0 == 1 and limits[t0] > 2 * k:
            out.append((t0, t1, *_prefiltered_topk(keys, b, query[b, t0], w[b, t0], limits[t0], k)))
            continue
        scale = None if query_scale is None else query_scale[b, t0:t1]
        q_rows = dequantize(query[b, t0:t1], scale)
        out.append((t0, t1, *_streamed_topk(keys, b, q_rows, w[b, t0:t1], limits[t0:t1], k)))
    return out


def _lightning_indexer_cpu(query: Tensor, key: Tensor, weights: Tensor, actual_seq_lengths_query: Tensor | None,
                           actual_seq_lengths_key: Tensor | None, block_table: Tensor | None,
                           query_scale: Tensor | None, key_scale: Tensor | None, sparse_count: int,
                           sparse_mode: int) -> tuple[Tensor, Tensor]:
    lq, lk = sequence_lengths(OP, query, key, block_table, actual_seq_lengths_query,
                              actual_seq_lengths_key, "actual_seq_lengths_key")
    keys = KeyReader(key, key_scale, block_table)
    w = weights.float()
    prefilter = BF16_PREFILTER and query.dtype == torch.bfloat16 and key.dtype == torch.bfloat16
    top_row = None if query_scale is not None or key_scale is not None else \
        lightning_indexer_native.row_topk(query, key, block_table, sparse_count)
    batch, s1 = query.shape[:2]
    indices = torch.full((batch, s1, 1, sparse_count), -1, dtype=torch.int32)
    values = torch.full((batch, s1, 1, sparse_count), float("-inf"), dtype=torch.float32)
    for b in range(batch):
        limits = [visible_keys(t, lq[b], lk[b], sparse_mode) for t in range(lq[b])]
        for t0, t1, idx, val in _batch_topk(keys, b, query, query_scale, w, limits, sparse_count, prefilter,
                                            top_row):
            indices[b, t0:t1, 0] = idx
            values[b, t0:t1, 0] = val
    return indices, values


@torch.library.custom_op("ascend_dsa::lightning_indexer", mutates_args=())
def lightning_indexer(query: Tensor, key: Tensor, weights: Tensor, actual_seq_lengths_query: Tensor | None = None,
                      actual_seq_lengths_key: Tensor | None = None, block_table: Tensor | None = None,
                      query_scale: Tensor | None = None, key_scale: Tensor | None = None, *,
                      layout_query: str = "BSND", layout_key: str = "BSND", sparse_count: int = 2048,
                      sparse_mode: int = 3, return_value: bool = False) -> tuple[Tensor, Tensor]:
    """Top-`sparse_count` key positions per query token; see the module docstring. Returns
    (sparse_indices int32 [B,S1,1,K], sparse_values fp32 [B,S1,1,K])."""
    if static_checks_needed():
        _check_static(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
                      query_scale, key_scale, layout_query, layout_key, sparse_count, sparse_mode)
    def run() -> tuple[Tensor, Tensor]:
        return _lightning_indexer_cpu(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key,
                                      block_table, query_scale, key_scale, sparse_count, sparse_mode)

    cls = native_class(query, key, weights, block_table=block_table, query_scale=query_scale, key_scale=key_scale)
    if cls is None:
        return run()
    return dispatch.run(OP, lightning_indexer_native.NATIVE_SOURCE, cls, run, dispatch.torch_path(run))


def native_class(query: Tensor, key: Tensor, weights: Tensor, *args: object, block_table: Tensor | None = None,
                 query_scale: Tensor | None = None, key_scale: Tensor | None = None, **kwargs: object) -> tuple | None:
    """The shape class kernels/dispatch.py measures for a call the native scorer takes (decode-sized rows of
    unscaled keys it reads), else None."""
    if query_scale is not None or key_scale is not None or query.shape[1] > PREFILTER_MAX_ROWS \
            or not lightning_indexer_native.takes(query, key):
        return None
    positions = key.shape[1] if block_table is None else block_table.shape[1] * key.shape[1]
    return dispatch.shape_class(query.dtype, key.dtype, block_table is not None, *query.shape[1:], positions)


@lightning_indexer.register_fake
def _lightning_indexer_fake(query, key, weights, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                            block_table=None, query_scale=None, key_scale=None, *, layout_query="BSND",
                            layout_key="BSND", sparse_count=2048, sparse_mode=3, return_value=False):
    _check_static(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
                  query_scale, key_scale, layout_query, layout_key, sparse_count, sparse_mode)
    batch, s1 = query.shape[:2]
    indices = query.new_empty((batch, s1, 1, sparse_count), dtype=torch.int32)
    return indices, query.new_empty((batch, s1, 1, sparse_count), dtype=torch.float32)

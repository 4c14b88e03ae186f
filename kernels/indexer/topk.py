"""The torch paths of `ascend_dsa::lightning_indexer` (kernels/indexer/lightning_indexer.py picks one per block of
query rows): the streamed exact top-K and the bf16 prefilter.

Streamed. Query rows are processed in blocks; the keys of a batch stream through in chunks (as many keys as keep the
chunk's [keys, rows·N1] scores within SCORE_BUDGET elements) that are converted (or dequantized) to fp32, scored by
one GEMM [chunk, D] @ [D, rows·N1] with the ReLU fused and a matvec with the weights per row, and merged into a
running top-K: score memory is bounded by SCORE_BUDGET whatever the context length (a decode row's 16 heads × 16K
keys fit in one chunk; a prefill block's do not).

Where the native kernel is built and takes the inputs (kernels/indexer/native.py: fp32/bf16/fp16 keys),
kernels/native/dispatch.py times it against these paths per shape class and keeps the faster: it scores every visible
key of a row in fp32 straight from the stored keys, then one top-K. Without it, decode rows (at most PREFILTER_MAX_ROWS
of kernels/indexer/lightning_indexer.py valid query rows in a batch; bf16 query and keys, more than 2K visible keys) on
a CPU with native bf16 dot products (AVX512-BF16: there a bf16 GEMM is ~2x an fp32 one; elsewhere it is emulated) take
a prefilter instead: one bf16 GEMM over all keys (fp32 accumulation, each dot product q_j·k rounded once to bf16,
unit roundoff u = 2^-8) and a small one over its ReLU give every key an approximate score A and Bnd = Σ_j
|w_j|·ReLU(q_j·k). Those roundings (and the weights', when they are not bf16 already) move A by at most 2u·Bnd
(3u·Bnd) from the fp32 score, so e = 2.1u·Bnd (3.1u·Bnd) bounds the error. τ, a value at or below the K-th largest A
− e (read off a sample and checked by a count), is reached by at least K true scores, so every key with A + e < τ is
out of the top K. The candidates left (K plus those within the margins) are gathered and scored in fp32, and the top
K among them is exactly the top K of the definition, values included.
Large temporaries (gathered rows, fp32 copies) live in per-thread scratch buffers reused across calls.
"""
import math

import torch
from torch import Tensor

from npu_graph.kernels.indexer.keys import KeyReader, linear

KEY_CHUNK = 4096          # fewest keys per fp32 GEMM in the streamed path
SCORE_BUDGET = 1 << 21    # elements of one [chunk, rows·N1] GEMM output: chunks grow to it (decode: few rows)
PREFILTER_CHUNK = 16384   # keys per bf16 GEMM in the prefilter
MARGIN_BF16_WEIGHTS = 2.1 * 2.0 ** -8     # e / Σ|w|·ReLU(q·k): 2u (+ slack) for bf16 u = 2^-8, see docstring
MARGIN_ROUNDED_WEIGHTS = 3.1 * 2.0 ** -8  # 3u (+ slack) when the weights are rounded to bf16 as well


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


def streamed_topk(keys: KeyReader, b: int, q_rows: Tensor, w_rows: Tensor, limits: list[int],
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


def approx_scores(keys: KeyReader, b: int, q_row: Tensor, w_row: Tensor, limit: int) -> tuple[Tensor, Tensor]:
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


def prefiltered_topk(keys: KeyReader, b: int, q_row: Tensor, w_row: Tensor, limit: int,
                      k: int) -> tuple[Tensor, Tensor]:
    """Top-k of one bf16 query row (module docstring): at least k true scores reach τ, a value at or below
    the k-th largest lower bound A − e, so keys with A + e < τ are pruned; the rest are scored in fp32."""
    approx, margin = approx_scores(keys, b, q_row, w_row, limit)
    # A bound that is not finite (a NaN or inf input, bf16 overflow) bounds nothing: it must not raise τ.
    lower = (approx - margin).nan_to_num_(nan=float("-inf"), posinf=float("-inf"), neginf=float("-inf"))
    tau = _kth_largest_bound(lower, k)
    upper = approx.add_(margin)
    candidates = torch.nonzero((upper >= tau) | upper.isnan()).squeeze(1)       # a NaN score ranks first
    exact = _chunk_scores(keys.float_rows(b, candidates), q_row.float().unsqueeze(0), w_row.unsqueeze(0))[0]
    top, where = exact.topk(k)
    if top[-1].isnan():     # more NaN scores than k: which are kept is torch.topk's choice over the whole row
        return streamed_topk(keys, b, q_row.float().unsqueeze(0), w_row.unsqueeze(0), [limit], k)
    positions = candidates[where].masked_fill(top == float("-inf"), -1)        # -inf counts as masked
    return positions.to(torch.int32).unsqueeze(0), top.unsqueeze(0)

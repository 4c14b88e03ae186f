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
Non-finite values. Scores follow IEEE arithmetic in fp32: ReLU keeps NaN (as torch.relu), inf · 0 is NaN (an
infinite weight meeting a ReLU of 0, a zero query value meeting an infinite key value) and inf − inf is NaN. A
NaN score ranks above every number, as torch.topk ranks it: a NaN in a query row or its weights makes all of its
scores NaN, one in a key that key's scores, and NaN-scored keys are kept first. A key scoring -inf counts as
masked: it is reported as -1 (value -inf). Keys a query does not see never reach it. When more keys score NaN (or
+inf) than sparse_count, they tie at the cut and which of them are kept is torch.topk's choice, as for keys tied
at any score: the native kernel settles such rows with one torch.topk over the row as the eager model masks it,
and the bf16 prefilter leaves them to the streamed top-K. Where a score's fp32 sum comes within rounding of
overflow (|score| near 3.4e38), whether it overflows depends on the order of additions, which differs between
the paths. Paged keys, MXFP8 inputs and the bf16 prefilter follow the same rule (a non-finite approximate score
bounds nothing there: its key stays a candidate).
MXFP8. query/key may be float8_e4m3fn with query_scale/key_scale of shape [..., D/32] (float8_e8m0fnu, or
uint8 holding the biased exponent e): each group of 32 values along D is multiplied by 2^(e − 127).
The CPU work is in kernels/indexer/topk.py (torch: streamed exact top-K, bf16 prefilter) and
kernels/indexer/native.py (native decode rows); the checks in kernels/indexer/checks.py and the readable
definition in kernels/indexer/reference.py.
"""
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from npu_graph.kernels.checks import static_checks_needed, tensors_given
from npu_graph.kernels.indexer import native as lightning_indexer_native
from npu_graph.kernels.indexer.checks import OP, check_static, sequence_lengths, visible_keys
from npu_graph.kernels.indexer.key_windows import check_starts, has_padding, indexer_by_row
from npu_graph.kernels.indexer.keys import KeyReader, dequantize, onednn_bf16
from npu_graph.kernels.indexer.reference import reference_lightning_indexer as reference_lightning_indexer
from npu_graph.kernels.indexer.topk import KEY_CHUNK, SCORE_BUDGET, prefiltered_topk, streamed_topk
from npu_graph.kernels.native import call_plans, dispatch

PREFILTER_MAX_ROWS = 8    # the bf16 prefilter takes batches of at most this many valid query rows


def bf16_prefilter() -> bool:
    """Whether decode rows of bf16 inputs take the bf16 prefilter (kernels/indexer/topk.py): where oneDNN runs
    bf16 products natively (emulated, they are slower than the fp32 pass they would save)."""
    return onednn_bf16()


def _batch_topk(keys: KeyReader, b: int, query: Tensor, query_scale: Tensor | None, w: Tensor,
                limits: list[int], k: int, prefilter: bool) -> list[tuple[int, int, Tensor, Tensor]]:
    """(first row, last row, indices, values) blocks covering the valid query rows of batch b (torch paths)."""
    n1 = query.shape[2]
    if prefilter and len(limits) <= PREFILTER_MAX_ROWS:
        blocks = [(t, t + 1) for t in range(len(limits))]
    else:
        step = max(1, SCORE_BUDGET // (KEY_CHUNK * n1))
        blocks = [(t, min(t + step, len(limits))) for t in range(0, len(limits), step)]
    out = []
    for t0, t1 in blocks:
        if max(limits[t0:t1]) == 0:
            continue
        if prefilter and t1 - t0 == 1 and limits[t0] > 2 * k:
            out.append((t0, t1, *prefiltered_topk(keys, b, query[b, t0], w[b, t0], limits[t0], k)))
            continue
        scale = None if query_scale is None else query_scale[b, t0:t1]
        q_rows = dequantize(query[b, t0:t1], scale)
        out.append((t0, t1, *streamed_topk(keys, b, q_rows, w[b, t0:t1], limits[t0:t1], k)))
    return out


def _torch_indexer(query: Tensor, key: Tensor, weights: Tensor, actual_seq_lengths_query: Tensor | None,
                   actual_seq_lengths_key: Tensor | None, block_table: Tensor | None,
                   query_scale: Tensor | None, key_scale: Tensor | None, sparse_count: int,
                   sparse_mode: int) -> tuple[Tensor, Tensor]:
    """The torch paths of `_batch_topk` (the native kernel's path is lightning_indexer_native.native_path)."""
    lq, lk = sequence_lengths(OP, query, key, block_table, actual_seq_lengths_query,
                              actual_seq_lengths_key, "actual_seq_lengths_key")
    w = weights.float()
    batch, s1 = query.shape[:2]
    indices = torch.full((batch, s1, 1, sparse_count), -1, dtype=torch.int32)
    values = torch.full((batch, s1, 1, sparse_count), float("-inf"), dtype=torch.float32)
    keys = None
    for b in range(batch):
        limits = [visible_keys(t, lq[b], lk[b], sparse_mode) for t in range(lq[b])]
        keys = keys or KeyReader(key, key_scale, block_table)
        prefilter = bf16_prefilter() and query.dtype == torch.bfloat16 and key.dtype == torch.bfloat16
        for t0, t1, idx, val in _batch_topk(keys, b, query, query_scale, w, limits, sparse_count, prefilter):
            indices[b, t0:t1, 0] = idx
            values[b, t0:t1, 0] = val
    return indices, values


@torch.library.custom_op("ascend_dsa::lightning_indexer", mutates_args=())
@tensors_given
def lightning_indexer(query: Tensor, key: Tensor, weights: Tensor, actual_seq_lengths_query: Tensor | None = None,
                      actual_seq_lengths_key: Tensor | None = None, block_table: Tensor | None = None,
                      query_scale: Tensor | None = None, key_scale: Tensor | None = None,
                      key_starts: Tensor | None = None, *, layout_query: str = "BSND", layout_key: str = "BSND",
                      sparse_count: int = 2048, sparse_mode: int = 3, return_value: bool = False
                      ) -> tuple[Tensor, Tensor]:
    """Top-`sparse_count` key positions per query token; see the module docstring (and kernels/indexer/key_windows.py
    for `key_starts`). Returns (sparse_indices int32 [B,S1,1,K], sparse_values fp32 [B,S1,1,K])."""
    if static_checks_needed():
        check_static(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
                      query_scale, key_scale, layout_query, layout_key, sparse_count, sparse_mode)
        check_starts(OP, key_starts, query.shape[0])
    return _lightning_indexer_cpu(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
                                  query_scale, key_scale, sparse_count, sparse_mode, key_starts,
                                  (layout_query, layout_key, return_value))


def _lightning_indexer_cpu(query: Tensor, key: Tensor, weights: Tensor, actual_seq_lengths_query: Tensor | None,
                           actual_seq_lengths_key: Tensor | None, block_table: Tensor | None,
                           query_scale: Tensor | None, key_scale: Tensor | None, sparse_count: int, sparse_mode: int,
                           key_starts: Tensor | None, layouts: tuple[str, str, bool]) -> tuple[Tensor, Tensor]:
    """The op's CPU work after its static checks: the plan of the call's signature, or the first call's path
    (which stores one); a left-padded batch (key_starts not all 0) goes by rows (key_windows.indexer_by_row).
    `layouts`: layout_query, layout_key and return_value, for the padded rows' calls."""
    signature = _signature(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
                           query_scale, key_scale, sparse_count, sparse_mode)
    plan = _PLANS.get(signature)
    result = None
    if plan is not None:      # None: a left-padded batch
        result = plan(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table, query_scale,
                      key_scale, key_starts)
    elif not has_padding(key_starts):
        result = _first_call(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
                             query_scale, key_scale, sparse_count, sparse_mode, signature)
    if result is not None:
        return result
    return indexer_by_row(lightning_indexer, query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key,
                          block_table, query_scale, key_scale, key_starts, layout_query=layouts[0],
                          layout_key=layouts[1], sparse_count=sparse_count, sparse_mode=sparse_mode,
                          return_value=layouts[2])


def _unpadded(fn: Callable[..., tuple[Tensor, Tensor]]) -> Callable[..., tuple[Tensor, Tensor] | None]:
    """A plan running fn(query, key, weights, lengths_q, lengths_k, block_table, query_scale, key_scale) when the
    call's key_starts (its last argument) are all 0, else returning None (the padded rows' path), as the native plan
    does."""
    def plan(*args: Any) -> tuple[Tensor, Tensor] | None:
        return None if has_padding(args[-1]) else fn(*args[:-1])
    return plan


def _first_call(query: Tensor, key: Tensor, weights: Tensor, actual_seq_lengths_query: Tensor | None,
                actual_seq_lengths_key: Tensor | None, block_table: Tensor | None, query_scale: Tensor | None,
                key_scale: Tensor | None, sparse_count: int, sparse_mode: int,
                signature: tuple | None) -> tuple[Tensor, Tensor]:
    """The op's first call of a signature (no padded rows): the implementation kernels/native/dispatch.py measured
    faster for the class (the native path, or `_torch_indexer`), storing the plan of the choice."""

    def run() -> tuple[Tensor, Tensor]:
        return _torch_indexer(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
                              query_scale, key_scale, sparse_count, sparse_mode)

    cls = native_class(query, key, weights, block_table=block_table, query_scale=query_scale, key_scale=key_scale)
    if cls is None:
        return run()
    native_plan = lightning_indexer_native.native_path(
        query, key, block_table, weights, sparse_count, sparse_mode, (actual_seq_lengths_query, actual_seq_lengths_key),
        functools.partial(sequence_lengths, OP, key_lengths_name="actual_seq_lengths_key"), (query_scale, key_scale))
    result = dispatch.run(OP, lightning_indexer_native.NATIVE_SOURCE, cls,
                          lambda: native_plan(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key,
                                              block_table, query_scale, key_scale), dispatch.torch_path(run))
    impl = dispatch.known(OP, cls)
    if impl is not None:
        _PLANS.put(signature, native_plan if impl == "native" else _unpadded(call_plans.without_native(
            functools.partial(_torch_indexer, sparse_count=sparse_count, sparse_mode=sparse_mode))))
    return result


_PLANS = call_plans.Plans(OP)


def _signature(query: Tensor, key: Tensor, weights: Tensor, query_lengths: Tensor | None,
               key_lengths: Tensor | None, block_table: Tensor | None, query_scale: Tensor | None,
               key_scale: Tensor | None, sparse_count: int, sparse_mode: int) -> tuple | None:
    """What a plan depends on (kernels/native/call_plans). Unpaged keys [B, S2, 1, D] grow by a row per decode step:
    their length and batch stride are left out (the plan reads them at each call) but for the power-of-two bucket of
    S2 that kernels/native/dispatch.py classes calls by."""
    keys = call_plans.tensor_key(key) if block_table is not None else \
        (call_plans.growing_key(key), dispatch.bucket(key.shape[1]))
    lengths = tuple(None if t is None else (t.dtype, t.shape) for t in (query_lengths, key_lengths))
    return (call_plans.tensor_key(query), keys, call_plans.tensor_key(weights), lengths,
            call_plans.tensor_key(block_table), query_scale is None, key_scale is None, sparse_count, sparse_mode)


def native_class(query: Tensor, key: Tensor, weights: Tensor, *args: object, block_table: Tensor | None = None,
                 query_scale: Tensor | None = None, key_scale: Tensor | None = None, **kwargs: object) -> tuple | None:
    """The shape class kernels/native/dispatch.py measures for a call the native scorer takes (float or MXFP8 keys it
    reads; decode and prefill rows alike), else None."""
    if not lightning_indexer_native.takes(query, key, key_scale):
        return None
    positions = key.shape[1] if block_table is None else block_table.shape[1] * key.shape[1]
    return dispatch.shape_class(query.dtype, key.dtype, block_table is not None, *query.shape[1:], positions)


@lightning_indexer.register_fake
def _lightning_indexer_fake(query, key, weights, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                            block_table=None, query_scale=None, key_scale=None, key_starts=None, *,
                            layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
                            return_value=False):
    check_static(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
                  query_scale, key_scale, layout_query, layout_key, sparse_count, sparse_mode)
    check_starts(OP, key_starts, query.shape[0])
    batch, s1 = query.shape[:2]
    indices = query.new_empty((batch, s1, 1, sparse_count), dtype=torch.int32)
    return indices, query.new_empty((batch, s1, 1, sparse_count), dtype=torch.float32)

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
Non-finite values. `scale_value` must be finite (else ValueError); it multiplies the query before the dot
products, as on the NPU. A NaN or inf in query, key or the rope parts makes logits NaN or ±inf: a head whose
largest logit is NaN or +inf gets NaN in attention_out, softmax_max and softmax_sum; a logit of -inf weighs 0,
and a head whose every logit is -inf counts as a token with no selected position. A NaN or inf in a selected
value row reaches the attention_out of every head that reads it (inf · 0 is NaN, as in IEEE arithmetic). Where a
logit's fp32 sum comes within rounding of overflow (|logit| near 3.4e38), whether it overflows depends on the order
of additions, which differs between the paths.
fp8 KV. key/value may be float8_e4m3fn with key_scale/value_scale fp32 of shape [..., Dl/128]: each tile of
128 values of a token is multiplied by its scale. key_rope may be float8_e4m3fn too, with key_rope_scale fp32 of
shape [..., 1]: one scale per token over its Dr values (an fp8 cache of DeepSeek-V3.2's sizes then holds 512 + 16
bytes of latent and 64 + 4 of RoPE key per token, against 1024 + 128 in bf16).

Fast CPU path: the native kernel (kernels/sparse_attention/native.py) whenever it loads and reads the KV rows; otherwise
scaled fp8 KV read over at least once is dequantized per batch for it, a decode step's selected fp8 rows are
decoded into a small buffer for it, and the rest takes the torch path
(kernels/sparse_attention/torch_path.py; a batch of at least BLOCKED_MIN_ROWS query tokens, a prefill chunk, in
batched GEMMs over blocks of tokens: kernels/sparse_attention/blocked.py). The measured dispatch picks between the
native kernel and the torch path per shape class. The checks are in kernels/sparse_attention/checks.py, the
readable definition in kernels/sparse_attention/reference.py.
"""
import functools

import torch
from torch import Tensor

from npu_graph.kernels.checks import static_checks_needed, tensors_given
from npu_graph.kernels.indexer.checks import sequence_lengths
from npu_graph.kernels.indexer.key_windows import check_start_values, check_starts, drop_padding, has_padding
from npu_graph.kernels.native import call_plans, dispatch
from npu_graph.kernels.sparse_attention import native as sfa_native
from npu_graph.kernels.sparse_attention import plan as sfa_plan
from npu_graph.kernels.sparse_attention.blocked import BLOCKED_MIN_ROWS, blocked_batch
from npu_graph.kernels.sparse_attention.checks import OP, check_data, check_scale, check_static
from npu_graph.kernels.sparse_attention.native import NATIVE_SOURCE
from npu_graph.kernels.sparse_attention.reference import non_finite_heads
from npu_graph.kernels.sparse_attention.reference import (
    reference_sparse_flash_attention as reference_sparse_flash_attention,
)
from npu_graph.kernels.sparse_attention.torch_path import kv_readers, torch_batch


def _batches_cpu(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float,
                 block_table: Tensor | None, actual_seq_lengths_query: Tensor | None,
                 actual_seq_lengths_kv: Tensor | None, query_rope: Tensor | None, key_rope: Tensor | None,
                 key_scale: Tensor | None, value_scale: Tensor | None, sparse_block_size: int,
                 sparse_mode: int, key_rope_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    check_data(sparse_indices)
    lq, lkv = sequence_lengths(OP, query, key, block_table, actual_seq_lengths_query, actual_seq_lengths_kv,
                               "actual_seq_lengths_kv")
    outs = sfa_plan.outputs(query)
    indices = sparse_indices.long().contiguous()
    kernel = sfa_native.native_kernel(key, value, key_rope, block_table)
    table = None if block_table is None else block_table.long().contiguous()
    args = (query, key, value, indices, scale_value, table, query_rope, key_rope, sparse_block_size, sparse_mode)
    readers = None
    for b in range(query.shape[0]):
        if lq[b] == 0 or (kernel is not None and sfa_native.native_batch(kernel, args, b, lq[b], lkv[b], outs)):
            continue
        readers = readers or kv_readers(key, value, key_rope, key_scale, value_scale, block_table, key_rope_scale)
        if sfa_native.rows_read(indices, sparse_block_size, lq[b], lkv[b]) >= lkv[b] and \
                sfa_native.native_dequantized(readers, args, b, lq[b], lkv[b], outs):
            continue
        if lq[b] < BLOCKED_MIN_ROWS and sfa_native.native_gathered(readers, args, b, lq[b], lkv[b], outs):
            continue
        path = blocked_batch if lq[b] >= BLOCKED_MIN_ROWS else torch_batch
        path(readers, query, query_rope, indices, scale_value, b, lq[b], lkv[b], sparse_block_size, sparse_mode,
             outs)
    return non_finite_heads(*outs)


_PLANS = call_plans.Plans(OP)
# Query tokens on which the measured dispatch times the paths of a larger call (`_probe_args`).
PROBE_ROWS = 32


@torch.library.custom_op("ascend_dsa::sparse_flash_attention", mutates_args=())
@tensors_given
def sparse_flash_attention(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float,
                           block_table: Tensor | None = None, actual_seq_lengths_query: Tensor | None = None,
                           actual_seq_lengths_kv: Tensor | None = None, query_rope: Tensor | None = None,
                           key_rope: Tensor | None = None, key_scale: Tensor | None = None,
                           value_scale: Tensor | None = None, key_starts: Tensor | None = None,
                           key_rope_scale: Tensor | None = None, *, sparse_block_size: int = 1,
                           layout_query: str = "BSND", layout_kv: str = "BSND", sparse_mode: int = 3,
                           return_softmax_lse: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Attention over the selected KV rows; see the module docstring (and kernels/indexer/key_windows.py for
    `key_starts`). Returns (attention_out [B,S1,N1,Dl] in query's dtype, softmax_max fp32 [B,S1,N1], softmax_sum
    fp32 [B,S1,N1]). The path is decided once per signature (kernels/sparse_attention/plan.py)."""
    if static_checks_needed():
        check_static(query, key, value, sparse_indices, block_table, actual_seq_lengths_query,
                      actual_seq_lengths_kv, query_rope, key_rope, key_scale, value_scale, sparse_block_size,
                      layout_query, layout_kv, sparse_mode, key_rope_scale)
        check_starts(OP, key_starts, query.shape[0])
        check_scale(scale_value)
    return _sparse_flash_attention_cpu(query, key, value, sparse_indices, scale_value, block_table,
                                       actual_seq_lengths_query, actual_seq_lengths_kv, query_rope, key_rope,
                                       key_scale, value_scale, key_starts, sparse_block_size, sparse_mode,
                                       key_rope_scale)


def _sparse_flash_attention_cpu(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor,
                                scale_value: float, block_table: Tensor | None,
                                actual_seq_lengths_query: Tensor | None, actual_seq_lengths_kv: Tensor | None,
                                query_rope: Tensor | None, key_rope: Tensor | None, key_scale: Tensor | None,
                                value_scale: Tensor | None, key_starts: Tensor | None, sparse_block_size: int,
                                sparse_mode: int, key_rope_scale: Tensor | None = None
                                ) -> tuple[Tensor, Tensor, Tensor]:
    """The op's CPU work after its static checks: the plan of the call's signature, or the full path (which
    stores one)."""
    args = (query, key, value, sparse_indices, scale_value, block_table, actual_seq_lengths_query,
            actual_seq_lengths_kv, query_rope, key_rope, key_scale, value_scale, key_starts, key_rope_scale)
    if key_starts is not None:
        check_start_values(OP, key_starts, key.shape[1] * (1 if block_table is None else block_table.shape[1]))
    # a paged cache keeps its shape; BSND key, value and key_rope grow by a row per decode step: the plan reads
    # their length at each call, the signature keeps only what the dispatch class reads of it (native_class)
    kv_key = call_plans.tensor_key if block_table is not None else call_plans.growing_key
    signature = (*map(call_plans.tensor_key, (query, sparse_indices, block_table, actual_seq_lengths_query,
                                              actual_seq_lengths_kv, query_rope, key_scale, value_scale, key_starts,
                                              key_rope_scale)),
                 *map(kv_key, (key, value, key_rope)), min(sparse_block_size, key.shape[1]), sparse_block_size,
                 sparse_mode)
    plan = _PLANS.get(signature)
    return plan(*args) if plan is not None else _first_call(args, signature, sparse_block_size, sparse_mode)


def _first_call(args: tuple, signature: tuple, sparse_block_size: int, sparse_mode: int
                ) -> tuple[Tensor, Tensor, Tensor]:
    """The full path: the native kernel or the torch path as kernels/native/dispatch.py measured for the class; stores
    the plan of the choice for `signature`."""
    full = functools.partial(_full_path, sparse_block_size=sparse_block_size, sparse_mode=sparse_mode)
    query, key, value, sparse_indices, _, block_table, _, _, query_rope, key_rope, *_ = args
    cls = native_class(query, key, value, sparse_indices, None, block_table, query_rope=query_rope,
                       key_rope=key_rope, sparse_block_size=sparse_block_size)
    if cls is None:
        _PLANS.put(signature, full)
        return full(*args)
    probe = _probe_args(args)
    result = dispatch.run(OP, NATIVE_SOURCE, cls, lambda: full(*args), dispatch.torch_path(lambda: full(*args)),
                          probe=None if probe is None else (lambda: full(*probe),
                                                            dispatch.torch_path(lambda: full(*probe))))
    impl = dispatch.known(OP, cls)
    if impl == "torch":
        _PLANS.put(signature, call_plans.without_native(full))
    elif impl == "native":
        kernel = sfa_native.native_kernel(key, value, key_rope, block_table)
        takes = kernel is not None and sfa_plan.takes(query, query_rope)
        lengths = args[6:8]
        _PLANS.put(signature, sfa_plan.native_plan(sfa_native.call_entry(), query, key, value, sparse_indices,
                                                    block_table, lengths, query_rope, key_rope, sparse_block_size,
                                                    sparse_mode, full) if takes else full)
    return result


def _probe_args(args: tuple) -> tuple | None:
    """The call's arguments cut to its first PROBE_ROWS query tokens, which the dispatch times in place of the
    whole call (a prefill chunk of 1K tokens at DeepSeek-V3.2 size takes seconds per path); None for a call of at
    most PROBE_ROWS tokens. With the causal mode the cut tokens see as many keys as the call's last ones."""
    query, key, value, sparse_indices, scale_value, block_table, lq, lkv, query_rope, *rest = args
    if query.shape[1] <= PROBE_ROWS:
        return None
    rows = slice(0, PROBE_ROWS)
    return (query[:, rows], key, value, sparse_indices[:, rows], scale_value, block_table,
            None if lq is None else lq.clamp(max=PROBE_ROWS), lkv,
            None if query_rope is None else query_rope[:, rows], *rest)


def _full_path(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float,
               block_table: Tensor | None, actual_seq_lengths_query: Tensor | None,
               actual_seq_lengths_kv: Tensor | None, query_rope: Tensor | None, key_rope: Tensor | None,
               key_scale: Tensor | None, value_scale: Tensor | None, key_starts: Tensor | None,
               key_rope_scale: Tensor | None = None, *, sparse_block_size: int, sparse_mode: int
               ) -> tuple[Tensor, Tensor, Tensor]:
    if has_padding(key_starts):
        sparse_indices = drop_padding(sparse_indices, key_starts, sparse_block_size)
    return _batches_cpu(query, key, value, sparse_indices, scale_value, block_table, actual_seq_lengths_query,
                        actual_seq_lengths_kv, query_rope, key_rope, key_scale, value_scale, sparse_block_size,
                        sparse_mode, key_rope_scale)


def native_class(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, *args: object,
                 query_rope: Tensor | None = None, key_rope: Tensor | None = None, sparse_block_size: int = 1,
                 **kwargs: object) -> tuple | None:
    """The shape class kernels/native/dispatch.py measures for a call the native kernel takes, else None."""
    block_table = args[1] if len(args) > 1 else kwargs.get("block_table")
    if sfa_native.native_kernel(key, value, key_rope, block_table) is None:
        return None
    rope = 0 if query_rope is None else query_rope.shape[3]
    return dispatch.shape_class(query.dtype, key.dtype, block_table is not None, *query.shape[1:], rope,
                                sparse_indices.shape[3] * min(sparse_block_size, key.shape[1]))


@sparse_flash_attention.register_fake
def _sparse_flash_attention_fake(query, key, value, sparse_indices, scale_value, block_table=None,
                                 actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                                 key_rope=None, key_scale=None, value_scale=None, key_starts=None,
                                 key_rope_scale=None, *, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                                 sparse_mode=3, return_softmax_lse=False):
    check_static(query, key, value, sparse_indices, block_table, actual_seq_lengths_query, actual_seq_lengths_kv,
                  query_rope, key_rope, key_scale, value_scale, sparse_block_size, layout_query, layout_kv,
                  sparse_mode, key_rope_scale)
    check_starts(OP, key_starts, query.shape[0])
    check_scale(scale_value)
    batch, s1, n1 = query.shape[:3]
    stats = query.new_empty((batch, s1, n1), dtype=torch.float32)
    return query.new_empty(query.shape), stats, torch.empty_like(stats)     # contiguous, as the CPU path returns

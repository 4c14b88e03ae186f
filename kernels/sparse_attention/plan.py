"""Per-signature plans of `ascend_dsa::sparse_flash_attention` (kernels/native/call_plans).

The op's CPU path decides at every call which implementation runs (kernels/native/dispatch.py), whether the native
kernel reads the KV tensors, and then for each batch takes views of the query, keys, indices and outputs only to read
their addresses; a decode call (one query token, a few selected rows) spent ~0.1 ms on that and ~5 us in the
kernel. A plan keeps those decisions for one signature (shapes, strides, dtypes, options). The native plan takes
fp32, bf16 and fp16 queries as stored (copied first when their rows do not lie one after another; the kernel
widens 16-bit ones and rounds the output back to their dtype itself: three torch calls fewer a call, 12 us in a
loop and ~90 us right after other work on the Zen 4) (`takes`: a bf16 decode call on the AVX2 EPYC spent ~0.4 ms
of 1.1 in the per-batch path's Python; bf16 queries and KV ask for the bf16 dot products where the build has
them, as the per-batch path does), KV in the BSND layout or paged, and
addresses each batch's rows from the tensors' base pointers (a paged cache's through the block table) with the
strides fixed; the data checks (sparse_indices, the sequence lengths, the block table, the key starts of a
left-padded batch) still run at every call, and a kernel that cannot get its scratch memory still sends the call
to the full path.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import Tensor

from npu_graph.kernels.indexer.checks import sequence_lengths
from npu_graph.kernels.indexer.key_windows import drop_padding
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import prototypes as native_prototypes
from npu_graph.kernels.native.call_plans import as_int, int_dtype
from npu_graph.kernels.sparse_attention import native as sfa_native
from npu_graph.kernels.sparse_attention.checks import OP, check_data
from npu_graph.kernels.sparse_attention.torch_path import same_tensor

Plan = Callable[..., tuple[Tensor, Tensor, Tensor]]


def _rows_contiguous(x: Tensor) -> bool:
    """[B, S1, N1, D] whose rows of each batch lie one after another (x[b, :lq] is contiguous for any lq)."""
    return x.stride(3) == 1 and x.stride(2) == x.shape[3] and x.stride(1) == x.shape[2] * x.shape[3]


def takes(query: Tensor, query_rope: Tensor | None) -> bool:
    """Whether `native_plan` serves this signature (KV BSND or paged): an fp32 query (and rope), or a bf16 or fp16
    one (fp16 where the build reads it), which the kernel widens to fp32 and whose output it rounds back to the
    query's dtype, as the per-batch path computes them. Queries whose rows do not lie one after another (heads
    transposed from [B, N1, S1, D]) are copied first."""
    dtypes = {query.dtype} | ({query_rope.dtype} if query_rope is not None else set())
    if dtypes == {torch.float16}:
        return sfa_native.reads_f16()
    return dtypes == {torch.float32} or dtypes == {torch.bfloat16}


def _as_rows(x: Tensor | None) -> Tensor | None:
    """x as the plan hands it to the kernel, which widens 16-bit values itself: its rows one after another (a copy
    unless they are already)."""
    return x if x is None or _rows_contiguous(x) else x.contiguous()


def outputs(query: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """attention_out, softmax_max and softmax_sum as the op returns them before any batch is written."""
    return (torch.zeros(query.shape, dtype=query.dtype, device=query.device),
            torch.full(query.shape[:3], float("-inf"), dtype=torch.float32, device=query.device),
            torch.zeros(query.shape[:3], dtype=torch.float32, device=query.device))


@native_prototypes.struct(sfa_native.NATIVE_SOURCE, "sfa_call_args")
class CallArgs(ctypes.Structure):
    """struct sfa_call_args of native/sparse_attention.c: what a plan fixes (its layout is checked against the C by
    tests/kernels/test_native_prototypes.py)."""
    _fields_ = [*((name, ctypes.c_int64) for name in (
        "batch", "s1", "H", "DL", "DR", "K", "block", "block_size", "num_blocks", "q_batch", "qr_batch", "idx_batch",
        "idx_token", "table_row", "kv_stride", "value_stride", "rope_stride", "split_rows")),
                *((name, ctypes.c_int) for name in ("idx64", "table64", "lq64", "lkv64", "causal", "kv_dtype",
                                                    "rope_dtype", "q_dtype"))]


_BAD_DATA = {2: "actual_seq_lengths_query", 3: "actual_seq_lengths_kv", 4: "sparse_indices", 5: "block_table"}
_PADDED_BLOCKS = 6


def _call_args(query: Tensor, key: Tensor, value: Tensor, dtypes: tuple, sparse_indices: Tensor,
               block_table: Tensor | None, query_rope: Tensor | None, key_rope: Tensor | None,
               sparse_block_size: int, sparse_mode: int) -> CallArgs:
    """The fixed part of the kernel's arguments for this signature (query and query_rope as the kernel reads them,
    in their dtype, which is the output's); dtypes: those of sparse_indices, block_table and the two lengths as
    the kernel reads them (contiguous: their strides follow from their shapes)."""
    batch, s1, n1, dl = query.shape
    top_k = sparse_indices.shape[3]
    return CallArgs(batch, s1, n1, dl, 0 if query_rope is None else query_rope.shape[3], top_k,
                    sparse_block_size, key.shape[1], key.shape[0], query.stride(0),
                    0 if query_rope is None else query_rope.stride(0), s1 * top_k, top_k,
                    0 if block_table is None else block_table.shape[1], key.stride(1), value.stride(1),
                    0 if key_rope is None else key_rope.stride(1), sfa_native.NATIVE_SPLIT_ROWS,
                    *(dtype is torch.int64 for dtype in dtypes), sparse_mode == 3,
                    native.DTYPE_CODES[key.dtype], native.DTYPE_CODES[(key if key_rope is None else key_rope).dtype],
                    native.DTYPE_CODES[query.dtype])


def native_plan(entry: ctypes._CFuncPtr, query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor,
                block_table: Tensor | None, lengths: tuple[Tensor | None, Tensor | None], query_rope: Tensor | None,
                key_rope: Tensor | None, sparse_block_size: int, sparse_mode: int, full_path: Plan) -> Plan:
    """The native kernel for calls of this signature (`takes` holds): one call of `entry` (sfa_call), which checks
    the data (lengths, block table, indices) and writes every output; a failed check is raised by the Python
    checks, with their messages, and a call whose kernel could not allocate its scratch memory goes to
    `full_path`."""
    dtypes = idx_dtype, table_dtype, lq_dtype, lkv_dtype = tuple(map(int_dtype, (sparse_indices, block_table,
                                                                                 *lengths)))
    fixed = _call_args(_as_rows(query), key, value, dtypes, sparse_indices, block_table,
                       _as_rows(query_rope), key_rope, sparse_block_size, sparse_mode)
    args = ctypes.byref(fixed)
    paged = block_table is not None
    out_dtype, out_shape, stats = query.dtype, tuple(query.shape), tuple(query.shape[:3])

    def plan(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float,
             block_table: Tensor | None, actual_seq_lengths_query: Tensor | None,
             actual_seq_lengths_kv: Tensor | None, query_rope: Tensor | None, key_rope: Tensor | None,
             key_scale: Tensor | None, value_scale: Tensor | None, key_starts: Tensor | None,
             key_rope_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        idx, table = as_int(sparse_indices, idx_dtype), as_int(block_table, table_dtype)
        q, q_rope = _as_rows(query), _as_rows(query_rope)
        starts = None if key_starts is None else as_int(key_starts, int_dtype(key_starts))
        lq, lkv = as_int(actual_seq_lengths_query, lq_dtype), as_int(actual_seq_lengths_kv, lkv_dtype)
        out = torch.empty(*out_shape, dtype=out_dtype)      # sizes as ints: a torch.Size costs ~1.5 us more
        smax, ssum = torch.empty(*stats, dtype=torch.float32), torch.empty(*stats, dtype=torch.float32)
        capacity = key.shape[1] * (table.shape[1] if paged else 1)
        shared = value is key or same_tensor(key, value)       # per call: the signature does not hold it
        status = entry(args, q.data_ptr(), None if q_rope is None else q_rope.data_ptr(), idx.data_ptr(),
                       None if table is None else table.data_ptr(), None if lq is None else lq.data_ptr(),
                       None if lkv is None else lkv.data_ptr(), None if starts is None else starts.data_ptr(),
                       starts is not None and starts.dtype is torch.int64, capacity, key.data_ptr(),
                       0 if paged else key.stride(0), None if shared else value.data_ptr(),
                       0 if paged else value.stride(0), None if key_rope is None else key_rope.data_ptr(),
                       0 if paged or key_rope is None else key_rope.stride(0), scale_value, torch.get_num_threads(),
                       out.data_ptr(), smax.data_ptr(), ssum.data_ptr())
        if status == 0:
            return out, smax, ssum
        if status == _PADDED_BLOCKS:
            drop_padding(sparse_indices, key_starts, sparse_block_size)      # raises: padding needs block 1
        if status in _BAD_DATA:          # the Python checks raise with their messages
            check_data(sparse_indices)
            sequence_lengths(OP, query, key, block_table, actual_seq_lengths_query, actual_seq_lengths_kv,
                             "actual_seq_lengths_kv")
            raise ValueError(f"{OP}: `{_BAD_DATA[status]}` holds a value out of range")
        return full_path(query, key, value, sparse_indices, scale_value, block_table, actual_seq_lengths_query,
                         actual_seq_lengths_kv, query_rope, key_rope, key_scale, value_scale, key_starts,
                         key_rope_scale)

    return plan

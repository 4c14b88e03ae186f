"""Per-signature plans of `ascend_dsa::sparse_flash_attention` (kernels/call_plans).

The op's CPU path decides at every call which implementation runs (kernels/dispatch.py), whether the native kernel
reads the KV tensors, and then for each batch takes views of the query, keys, indices and outputs only to read
their addresses; a decode call (one query token, a few selected rows) spent ~0.1 ms on that and ~5 us in the
kernel. A plan keeps those decisions for one signature (shapes, strides, dtypes, options). The native plan takes
fp32 queries whose rows lie contiguously, KV in the BSND layout or paged, and addresses each batch's rows from
the tensors' base pointers (a paged cache's through the block table) with the strides fixed; the data checks
(sparse_indices, the sequence lengths, the block table, the key starts of a left-padded batch) still run at every
call, and a kernel that cannot get its scratch memory still sends the call to the full path.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import Tensor

from npu_graph.kernels import native, sfa_native
from npu_graph.kernels.indexer_checks import sequence_lengths
from npu_graph.kernels.key_windows import drop_padding, has_padding
from npu_graph.kernels.sfa_checks import OP, check_data
from npu_graph.kernels.sfa_torch import same_tensor

Plan = Callable[..., tuple[Tensor, Tensor, Tensor]]


def _rows_contiguous(x: Tensor) -> bool:
    """[B, S1, N1, D] whose rows of each batch lie one after another (x[b, :lq] is contiguous for any lq)."""
    return x.stride(3) == 1 and x.stride(2) == x.shape[3] and x.stride(1) == x.shape[2] * x.shape[3]


def takes(query: Tensor, query_rope: Tensor | None) -> bool:
    """Whether `native_plan` serves this signature: fp32 query (and rope) rows stored contiguously (KV BSND or
    paged)."""
    return (query.dtype == torch.float32 and _rows_contiguous(query)
            and (query_rope is None or (query_rope.dtype == torch.float32 and _rows_contiguous(query_rope))))


def outputs(query: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """attention_out, softmax_max and softmax_sum as the op returns them before any batch is written."""
    return (torch.zeros(query.shape, dtype=query.dtype, device=query.device),
            torch.full(query.shape[:3], float("-inf"), dtype=torch.float32, device=query.device),
            torch.zeros(query.shape[:3], dtype=torch.float32, device=query.device))


def native_plan(kernel: ctypes._CFuncPtr, query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor,
                query_rope: Tensor | None, key_rope: Tensor | None, sparse_block_size: int, sparse_mode: int,
                full_path: Plan) -> Plan:
    """The native kernel for calls of this signature (`takes` holds); `full_path` runs a call whose kernel could not
    allocate its scratch memory."""
    batch, s1, n1, dl = query.shape
    rope_dim = 0 if query_rope is None else query_rope.shape[3]
    q_step, rope_step = query.stride(0) * 4, 0 if query_rope is None else query_rope.stride(0) * 4
    key_item, key_stride, value_item, value_stride = key.element_size(), key.stride(1), value.element_size(), \
        value.stride(1)
    k_rope_item, k_rope_stride = (0, 0) if key_rope is None else (key_rope.element_size(), key_rope.stride(1))
    codes = native.DTYPE_CODES[key.dtype], native.DTYPE_CODES[key.dtype if key_rope is None else key_rope.dtype]
    top_k, causal = sparse_indices.shape[3], sparse_mode == 3
    out_step, stat_step = s1 * n1 * dl * 4, s1 * n1 * 4

    def plan(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float,
             block_table: Tensor | None, actual_seq_lengths_query: Tensor | None,
             actual_seq_lengths_kv: Tensor | None, query_rope: Tensor | None, key_rope: Tensor | None,
             key_scale: Tensor | None, value_scale: Tensor | None,
             key_starts: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        if has_padding(key_starts):
            sparse_indices = drop_padding(sparse_indices, key_starts, sparse_block_size)
        check_data(sparse_indices)
        lq, lkv = sequence_lengths(OP, query, key, block_table, actual_seq_lengths_query, actual_seq_lengths_kv,
                                   "actual_seq_lengths_kv")
        outs = outputs(query)
        indices = sparse_indices.long().contiguous()
        table = None if block_table is None else block_table.long().contiguous()
        shared = value is key or same_tensor(key, value)
        q, k, v, idx = query.data_ptr(), key.data_ptr(), value.data_ptr(), indices.data_ptr()
        qr, kr = (None, None) if query_rope is None else (query_rope.data_ptr(), key_rope.data_ptr())
        out, smax, ssum = (t.data_ptr() for t in outs)
        threads = torch.get_num_threads()
        # the KV length (rows) and so the batch strides may differ from call to call: a growing decode cache; a
        # paged cache's rows are found through the block table (rows = its block size), the same blocks for all
        rows, key_step, value_step = key.shape[1], key.stride(0) * key_item, value.stride(0) * value_item
        k_rope_step = 0 if key_rope is None else key_rope.stride(0) * k_rope_item
        if table is not None:
            key_step = value_step = k_rope_step = 0
        for b in range(batch):
            if lq[b] == 0:
                continue
            values = (None, 0) if shared else (v + b * value_step, value_stride)
            ok = kernel(q + b * q_step, None if qr is None else qr + b * rope_step, n1, dl, rope_dim,
                        idx + b * indices.stride(0) * 8, indices.stride(1), top_k, sparse_block_size, lq[b], lkv[b],
                        causal, None if table is None else table[b].data_ptr(), rows, k + b * key_step, key_stride,
                        values[0], values[1],
                        None if kr is None else kr + b * k_rope_step, k_rope_stride, codes[0], codes[1], scale_value,
                        False, threads, sfa_native.NATIVE_SPLIT_ROWS, out + b * out_step, smax + b * stat_step,
                        ssum + b * stat_step)
            if not ok:
                return full_path(query, key, value, sparse_indices, scale_value, block_table,
                                 actual_seq_lengths_query, actual_seq_lengths_kv, query_rope, key_rope, key_scale,
                                 value_scale, None)
        return outs

    return plan

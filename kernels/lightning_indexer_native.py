"""Native scoring and top-K for `ascend_dsa::lightning_indexer` query rows (kernels/native/lightning_indexer.c,
built at first use by kernels/native.py).

For one query token it computes score[s] = Σ_j w_j·ReLU(q_j·k_s) for every visible key s in fp32, straight
from the stored fp32 / bf16 / fp16 keys (BSND rows or a paged cache through its block table): no fp32 copy
of the keys and no [heads × keys] matrix. bf16 query and keys use bf16 dot products on CPUs that have them
(AVX512-BF16: each product is exact in fp32 and the sums are fp32, as in an fp32 GEMM); elsewhere chunks of keys
are widened to fp32 and scored with fp32 fused multiply-adds. The top-K of these scores is the top-K of the
definition (no prefilter margins needed), selected natively (kernels/native/topk_select.h). The keys of a row are
shared by torch.get_num_threads() OpenMP threads (torch's pool).

`native_path` and `row_scorer` return None when the library is not loaded (no compiler, ASCEND_DSA_NATIVE=0) or the
inputs are not ones it reads (fp8 keys, keys whose head dim is not contiguous): the caller keeps its torch path
then.
"""
import ctypes
import functools
from collections.abc import Callable

import torch
from torch import Tensor

from npu_graph.kernels import native, native_prototypes
from npu_graph.kernels.indexer_keys import scratch

NATIVE_SOURCE = "lightning_indexer"


@functools.cache
def _typed(lib: ctypes.CDLL) -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr, ctypes._CFuncPtr, bool, bool,
                                      ctypes._CFuncPtr]:
    """(li_scores, li_topk, li_row_topk, whether the build reads fp16, whether it has bf16 dot products,
    li_rows_topk)."""
    has_f16 = native_prototypes.typed(lib, NATIVE_SOURCE, "li_has_f16")
    has_bf16_dot = native_prototypes.typed(lib, NATIVE_SOURCE, "li_has_bf16_dot")
    scores = native_prototypes.typed(lib, NATIVE_SOURCE, "li_scores")
    topk = native_prototypes.typed(lib, NATIVE_SOURCE, "li_topk")
    row_topk = native_prototypes.typed(lib, NATIVE_SOURCE, "li_row_topk")
    rows_topk = native_prototypes.typed(lib, NATIVE_SOURCE, "li_rows_topk")
    return scores, topk, row_topk, bool(has_f16()), bool(has_bf16_dot()), rows_topk


def _readable(key: Tensor) -> bool:
    """Row r of batch b at key[b].data_ptr() + r·stride(1), or of a cache block at block·stride(0) + r·stride(1)."""
    return key.device.type == "cpu" and key.stride(3) == 1 and key.dtype in native.DTYPE_CODES


def _kernel(query: Tensor, key: Tensor) -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr, ctypes._CFuncPtr, bool] | None:
    """(li_scores, li_topk, li_row_topk, whether to use bf16 dot products) for these inputs, or None (module
    docstring)."""
    loaded = native.load(NATIVE_SOURCE)
    if not loaded or query.dtype not in native.DTYPE_CODES or not _readable(key):
        return None
    scores, topk, row_topk_fn, has_f16, has_bf16_dot, _ = _typed(loaded.lib)
    if torch.float16 in (key.dtype, query.dtype) and not has_f16:
        return None
    bf16_dot = has_bf16_dot and query.dtype == key.dtype == torch.bfloat16 \
        and query.shape[3] % 2 == 0
    return scores, topk, row_topk_fn, bf16_dot


def takes(query: Tensor, key: Tensor) -> bool:
    """Whether the native kernel is loaded and reads these inputs."""
    return _kernel(query, key) is not None


def _out_of_memory(what: str) -> MemoryError:
    return MemoryError(f"lightning_indexer: the native kernel could not allocate its buffers ({what}); set "
                       f"{native.ENV_SWITCH}=0 to use the torch path")


def row_scorer(query: Tensor, key: Tensor, block_table: Tensor | None) -> Callable[..., Tensor] | None:
    """`score(b, limit, q_row [N1, D], w_row [N1]) -> scores [limit] fp32` of keys 0 .. limit-1 of batch b for one
    query token, or None when the native kernel does not take these inputs (module docstring)."""
    found = _kernel(query, key)
    if found is None:
        return None
    fn, bf16_dot, keys_of = found[0], int(found[3]), _key_args(key, block_table)

    def score(b: int, limit: int, q_row: Tensor, w_row: Tensor) -> Tensor:
        heads, dim = q_row.shape
        q, w = q_row.contiguous(), w_row.float().contiguous()      # the kernel reads q in its stored dtype
        out = torch.empty(limit, dtype=torch.float32, device="cpu")
        if fn(*keys_of(b), limit, q.data_ptr(), native.DTYPE_CODES[q.dtype], w.data_ptr(), heads, dim, bf16_dot,
              torch.get_num_threads(), out.data_ptr()):
            raise _out_of_memory(f"{limit} keys, {heads} heads of dim {dim}")
        return out

    return score


def _key_args(key: Tensor, block_table: Tensor | None) -> Callable[[int], tuple]:
    """The kernel's first six arguments (where batch b's key rows are) as a function of b."""
    code, row_stride, item = native.DTYPE_CODES[key.dtype], key.stride(1), key.element_size()
    if block_table is None:
        base, batch_stride = key.data_ptr(), key.stride(0) * item
        return lambda b: (base + b * batch_stride, code, row_stride, 0, None, 1)
    table = block_table.to(torch.int32).contiguous()     # kept alive by the function below

    def paged(b: int) -> tuple:
        return key.data_ptr(), code, row_stride, key.stride(0), table.data_ptr() + b * table.stride(0) * 4, \
            key.shape[1]

    return paged


def select_topk(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest of scores [n] (fp32, contiguous) by the native radix select (the library must be loaded):
    (positions [1, k] int32, values [1, k] fp32), sorted descending, equal scores by position, -1 / -inf padding
    when n < k."""
    select = _typed(native.load(NATIVE_SOURCE).lib)[1]
    indices = torch.empty(1, k, dtype=torch.int32, device="cpu")
    values = torch.empty(1, k, dtype=torch.float32, device="cpu")
    if select(scores.data_ptr(), scores.numel(), k, indices.data_ptr(), values.data_ptr()) < 0:
        raise _out_of_memory(f"top {k} of {scores.numel()} keys")
    return indices, values


def native_path(query: Tensor, key: Tensor, block_table: Tensor | None, weights: Tensor, k: int,
                lengths: Callable[..., tuple[list[int], list[int]]], visible: Callable[[int, int, int], int]
                ) -> Callable[..., tuple[Tensor, Tensor]] | None:
    """The op's native path for calls of these operands' signature, with everything that depends on neither the
    data nor the key length decided once (the plan kernels/call_plans keeps; a decode graph's cache grows by a
    row per step, so the key rows' count and batch stride are read at each call); None when the kernel does not
    take them. A decode row's keys are shared by the threads (li_row_topk), a prefill's rows go to the threads
    in one call (li_rows_topk). Which of several equal scores at the k-th place are kept is torch.topk's choice,
    as in eager (ReLU makes exact zeros common: a model's greedy tokens must not depend on the implementation).
    `lengths(query, key, block_table, lq_tensor, lk_tensor)` checks and returns the sequence lengths and
    `visible(row, lq, lk)` the keys a row sees, at every call."""
    found = _kernel(query, key)
    if found is None:
        return None
    fn, bf16_dot = found[2], int(found[3])
    batch, s1, heads, dim = query.shape
    q_code, q_item, copy_query = native.DTYPE_CODES[query.dtype], query.element_size(), not (
        query.stride(3) == 1 and query.stride(2) == dim)
    w_float = weights.dtype is torch.float32 and weights.is_contiguous()
    rows_fn, score_fn = _typed(native.load(NATIVE_SOURCE).lib)[5], found[0]

    def several(keys: tuple, limits: list[int], q_row: int, q_step: int, w_row: int, w_step: int, threads: int,
                out: tuple[int, int], indices: Tensor, values: Tensor) -> None:
        """A batch's query rows (a prefill) in one call, shared by the threads; rows with equal scores at the cut
        are scored again and settled by torch.topk."""
        limit_list = torch.tensor(limits, dtype=torch.int64)
        ties = torch.zeros(len(limits), dtype=torch.int32)
        if rows_fn(*keys, limit_list.data_ptr(), len(limits), q_row, q_code, q_step, w_row, w_step, heads, dim,
                   bf16_dot, threads, k, *out, ties.data_ptr()):
            raise _out_of_memory(f"{len(limits)} rows of up to {max(limits)} keys, {heads} heads of dim {dim}")
        for t in ties.nonzero().flatten().tolist():
            scores = torch.empty(limits[t], dtype=torch.float32)
            if score_fn(*keys, limits[t], q_row + t * q_step * q_item, q_code, w_row + t * w_step * 4, heads, dim,
                        bf16_dot, threads, scores.data_ptr()):
                raise _out_of_memory(f"{limits[t]} keys, {heads} heads of dim {dim}")
            values[t, 0], indices[t, 0] = scores.topk(k)

    def plan(query: Tensor, key: Tensor, weights: Tensor, lq_tensor: Tensor | None, lk_tensor: Tensor | None,
             block_table: Tensor | None) -> tuple[Tensor, Tensor]:
        lq, lk = lengths(query, key, block_table, lq_tensor, lk_tensor)
        q = query.contiguous() if copy_query else query
        w = weights if w_float else weights.float().contiguous()
        indices = torch.full((batch, s1, 1, k), -1, dtype=torch.int32)
        values = torch.full((batch, s1, 1, k), float("-inf"), dtype=torch.float32)
        keys_of, threads = _key_args(key, block_table), torch.get_num_threads()   # the key length of this call
        for b in range(batch):
            keys = keys_of(b)
            limits = [visible(t, lq[b], lk[b]) for t in range(lq[b])]
            q_row, w_row = q.data_ptr() + b * q.stride(0) * q_item, w.data_ptr() + b * w.stride(0) * 4
            out = (indices.data_ptr() + b * s1 * k * 4, values.data_ptr() + b * s1 * k * 4)
            if len(limits) > 1:
                several(keys, limits, q_row, q.stride(1), w_row, w.stride(1), threads, out, indices[b], values[b])
            elif limits and limits[0]:
                scores = scratch("li_native/scores", (limits[0],), torch.float32)
                status = fn(*keys, limits[0], q_row, q_code, w_row, heads, dim, bf16_dot, threads, k,
                            scores.data_ptr(), *out)
                if status < 0:
                    raise _out_of_memory(f"{limits[0]} keys, {heads} heads of dim {dim}, top {k}")
                if status:      # equal scores straddle the cut: torch.topk decides
                    values[b, 0, 0], indices[b, 0, 0] = scores.topk(k)
        return indices, values

    return plan

"""Native scoring and top-K for `ascend_dsa::lightning_indexer` query rows (kernels/native/lightning_indexer.c,
built at first use by kernels/native/loader.py).

For one query token it computes score[s] = Σ_j w_j·ReLU(q_j·k_s) for every visible key s in fp32, straight
from the stored fp32 / bf16 / fp16 keys or MXFP8 keys with their E8M0 scales (BSND rows or a paged cache through
its block table): no fp32 copy of the keys, no dequantized cache and no [heads × keys] matrix. An MXFP8 key is
decoded exactly where it is scored (a few rows at a time), an MXFP8 query once per call into bf16 (exact too: a
code has 4 significant bits, a power-of-two scale none). Int8 keys (one fp32 scale a row, Ascend's per-token int8)
are decoded where they are scored too, an int8 query once per call into fp32. bf16 query and bf16 or MXFP8 keys
use bf16 dot products
on CPUs that have them (AVX512-BF16: each product is exact in fp32 and the sums are fp32, as in an fp32 GEMM;
bf16 subnormals, values below 2^-126 that only a block of tiny MXFP8 values reaches, count as zero); elsewhere
chunks of keys are widened to fp32 and scored with fp32 fused multiply-adds. The top-K of these scores is the
top-K of the definition (no prefilter margins needed), selected natively (kernels/native/topk_select.h). The keys
of a row are shared by torch.get_num_threads() OpenMP threads (torch's pool).

`native_path` and `row_scorer` return None when the library is not loaded (no compiler, ASCEND_DSA_NATIVE=0) or the
inputs are not ones it reads (fp8 or int8 keys without scales, keys or scales whose last dim is not contiguous): the
caller keeps its torch path then.
"""
import ctypes
import functools
from collections.abc import Callable

import torch
from torch import Tensor

from npu_graph.kernels.indexer.checks import FP8
from npu_graph.kernels.indexer.key_windows import leading_masked_keys
from npu_graph.kernels.indexer.keys import dequantize
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import prototypes as native_prototypes
from npu_graph.kernels.native.call_plans import as_int, as_table32, int_dtype
from npu_graph.runtime.serial_calls import serial_when_small

NATIVE_SOURCE = "lightning_indexer"
_TOPK = serial_when_small("topk.default", torch.topk)    # tied rows are few: no thread team woken for them
E4M3, I8 = 3, 4     # the kernel's codes of float8_e4m3fn and int8 keys (kernels/native/float_io.h)
INT8 = torch.int8


@functools.cache
def _typed(lib: ctypes.CDLL) -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr, bool, bool, ctypes._CFuncPtr,
                                      tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]]:
    """(li_scores, li_topk, whether the build reads fp16, whether it has bf16 dot products, li_call,
    (li_tied_scores, li_place_rows))."""
    has_f16 = native_prototypes.typed(lib, NATIVE_SOURCE, "li_has_f16")
    has_bf16_dot = native_prototypes.typed(lib, NATIVE_SOURCE, "li_has_bf16_dot")
    scores = native_prototypes.typed(lib, NATIVE_SOURCE, "li_scores")
    topk = native_prototypes.typed(lib, NATIVE_SOURCE, "li_topk")
    call = native_prototypes.typed(lib, NATIVE_SOURCE, "li_call")
    tied = native_prototypes.typed(lib, NATIVE_SOURCE, "li_tied_scores"), \
        native_prototypes.typed(lib, NATIVE_SOURCE, "li_place_rows")
    return scores, topk, bool(has_f16()), bool(has_bf16_dot()), call, tied


def _readable(key: Tensor, key_scale: Tensor | None) -> bool:
    """Row r of batch b at key[b].data_ptr() + r·stride(1), or of a cache block at block·stride(0) + r·stride(1); an
    fp8 or int8 key's scale rows likewise."""
    if key.dtype in (FP8, INT8):
        return key_scale is not None and key.device.type == "cpu" and key.stride(3) == 1 and key_scale.stride(3) == 1
    return key.device.type == "cpu" and key.stride(3) == 1 and key.dtype in native.DTYPE_CODES


def _query_dtype(query: Tensor) -> torch.dtype:
    """The dtype the kernel reads the query in: its own, bf16 for an MXFP8 query and fp32 for an int8 one (decoded
    per call)."""
    return torch.bfloat16 if query.dtype == FP8 else torch.float32 if query.dtype == INT8 else query.dtype


def _kernel(query: Tensor, key: Tensor, key_scale: Tensor | None = None
            ) -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr, bool, tuple] | None:
    """(li_scores, li_call, whether to use bf16 dot products, (li_tied_scores, li_place_rows)) for these inputs, or
    None (module docstring)."""
    loaded = native.load(NATIVE_SOURCE)
    q_dtype = _query_dtype(query)
    if not loaded or q_dtype not in native.DTYPE_CODES or not _readable(key, key_scale):
        return None
    scores, _, has_f16, has_bf16_dot, call, tied = _typed(loaded.lib)
    if torch.float16 in (key.dtype, q_dtype) and not has_f16:
        return None
    bf16_dot = has_bf16_dot and q_dtype == torch.bfloat16 and key.dtype in (torch.bfloat16, FP8) and \
        query.shape[3] % 2 == 0
    return scores, call, bf16_dot, tied


def takes(query: Tensor, key: Tensor, key_scale: Tensor | None = None) -> bool:
    """Whether the native kernel is loaded and reads these inputs."""
    return _kernel(query, key, key_scale) is not None


def _key_code(key: Tensor) -> int:
    return E4M3 if key.dtype == FP8 else I8 if key.dtype == INT8 else native.DTYPE_CODES[key.dtype]


def decoded_query(query: Tensor, query_scale: Tensor | None) -> Tensor:
    """The query as the kernel reads it: an MXFP8 query decoded into bf16 (exact), an int8 one into fp32 (one
    rounding a value), any other as it is."""
    return query if query_scale is None else dequantize(query, query_scale).to(_query_dtype(query))


def _out_of_memory(what: str) -> MemoryError:
    return MemoryError(f"lightning_indexer: the native kernel could not allocate its buffers ({what}); set "
                       f"{native.ENV_SWITCH}=0 to use the torch path")


def row_scorer(query: Tensor, key: Tensor, block_table: Tensor | None, key_scale: Tensor | None = None
               ) -> Callable[..., Tensor] | None:
    """`score(b, limit, q_row [N1, D], w_row [N1], out=None) -> scores [limit] fp32` of keys 0 .. limit-1 of batch b
    for one query token (written into `out`, a contiguous fp32 [limit], when given), or None when the native kernel
    does not take these inputs (module docstring). An MXFP8 key comes with its `key_scale`; `q_row` is then a
    float query (bf16 for the bf16 dot products)."""
    found = _kernel(query, key, key_scale)
    if found is None:
        return None
    fn, bf16_dot, keys_of = found[0], int(found[2]), _key_args(key, block_table, key_scale)

    def score(b: int, limit: int, q_row: Tensor, w_row: Tensor, out: Tensor | None = None) -> Tensor:
        heads, dim = q_row.shape
        q, w = q_row.contiguous(), w_row.float().contiguous()      # the kernel reads q in its stored dtype
        out = torch.empty(limit, dtype=torch.float32, device="cpu") if out is None else out
        status = fn(*keys_of(b), limit, q.data_ptr(), native.DTYPE_CODES[q.dtype], w.data_ptr(), heads, dim, bf16_dot,
                    torch.get_num_threads(), out.data_ptr())
        if status == -2:
            raise ValueError(f"lightning_indexer: MXFP8 keys need their scales and a head dim that is a multiple of "
                             f"32 (got {dim}), int8 keys their scales")
        if status:
            raise _out_of_memory(f"{limit} keys, {heads} heads of dim {dim}")
        return out

    return score


def _key_args(key: Tensor, block_table: Tensor | None, key_scale: Tensor | None) -> Callable[[int], tuple]:
    """The kernel's first nine arguments (where batch b's key rows and scale rows are) as a function of b."""
    code, row_stride, item = _key_code(key), key.stride(1), key.element_size()
    scale = None if key_scale is None else key_scale.view(torch.uint8)      # kept alive by the functions below
    scale_ptr, scale_row = (None, 0) if scale is None else (scale.data_ptr(), scale.stride(1))
    if block_table is None:
        base, batch_stride = key.data_ptr(), key.stride(0) * item
        return lambda b: (base + b * batch_stride, code, row_stride, 0, None, 1,
                          None if scale is None else scale_ptr + b * scale.stride(0), scale_row, 0)
    table = as_table32(block_table)

    def paged(b: int) -> tuple:
        return key.data_ptr(), code, row_stride, key.stride(0), table.data_ptr() + b * table.stride(0) * 4, \
            key.shape[1], scale_ptr, scale_row, 0 if scale is None else scale.stride(0)

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


@native_prototypes.struct(NATIVE_SOURCE, "li_call_args")
class CallArgs(ctypes.Structure):
    """struct li_call_args of native/lightning_indexer.c: what a plan fixes (its layout is checked against the C by
    tests/kernels/test_native_prototypes.py)."""
    _fields_ = [*((name, ctypes.c_int64) for name in (
        "batch", "s1", "heads", "dim", "k", "block_size", "num_blocks", "block_stride", "q_batch", "q_row", "w_batch",
        "w_row", "key_row", "table_row", "scale_row", "scale_block")),
                *((name, ctypes.c_int) for name in ("lq64", "lk64", "causal", "key_dtype", "q_dtype", "bf16_dot"))]


_LI_TIES, _LI_PADDED, _LI_NO_MEMORY, _LI_BAD_KEY_SCALE = 5, 6, 1, 7


def native_path(query: Tensor, key: Tensor, block_table: Tensor | None, weights: Tensor, k: int, sparse_mode: int,
                lengths: tuple[Tensor | None, Tensor | None], check_lengths: Callable[..., tuple[list[int], list[int]]],
                scales: tuple[Tensor | None, Tensor | None] = (None, None)
                ) -> Callable[..., tuple[Tensor, Tensor] | None] | None:
    """The op's native path for calls of these operands' signature (the plan kernels/native/call_plans keeps), or None
    when the kernel does not take them: one li_call per op call, which checks the lengths and the block table,
    scores every batch's rows (a decode row's keys shared by the threads, a prefill's rows handed to them) and
    writes every output. A BSND cache grows by a row per decode step: its length and batch stride are read at
    each call. The plan returns None for a left-padded batch (key_starts not all 0: the caller's padded path); a
    failed check is raised by `check_lengths(query, key, block_table, lq, lk)` with its message; rows whose k-th
    and (k+1)-th scores are equal are scored again (one li_tied_scores call) and settled by torch.topk over rows as
    long as the keys the layout holds, as in an eager model's masked score matrix (ReLU makes exact zeros common: a
    model's greedy tokens must not depend on the implementation). `scales`: the (query_scale, key_scale) of MXFP8
    or int8 operands; the plan takes the call's own after block_table. A quantized query is decoded at each call."""
    found = _kernel(query, key, scales[1])
    if found is None:
        return None
    batch, s1, heads, dim = query.shape
    decode = scales[0] is not None
    paged, copy_query = block_table is not None, decode or not (query.stride(3) == 1 and query.stride(2) == dim)
    q_strides = query.contiguous().stride() if copy_query else query.stride()
    key_scale = None if scales[1] is None else scales[1].view(torch.uint8)
    w_float = weights.dtype is torch.float32 and weights.is_contiguous()
    w_strides = weights.stride() if w_float else weights.float().contiguous().stride()
    lq_dtype, lk_dtype = map(int_dtype, lengths)
    fixed = CallArgs(batch, s1, heads, dim, k, key.shape[1] if paged else 1, key.shape[0] if paged else 0,
                     key.stride(0) if paged else 0, q_strides[0], q_strides[1], w_strides[0], w_strides[1],
                     key.stride(1), block_table.shape[1] if paged else 0,
                     0 if key_scale is None else key_scale.stride(1),
                     0 if key_scale is None or not paged else key_scale.stride(0), lq_dtype is torch.int64,
                     lk_dtype is torch.int64, sparse_mode != 0, _key_code(key),
                     native.DTYPE_CODES[_query_dtype(query)], int(found[2]))
    args, entry, (tied_scores, place_rows) = ctypes.byref(fixed), found[1], found[3]

    def plan(query: Tensor, key: Tensor, weights: Tensor, lq_tensor: Tensor | None, lk_tensor: Tensor | None,
             block_table: Tensor | None, query_scale: Tensor | None = None, key_scale: Tensor | None = None,
             key_starts: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
        q = decoded_query(query, query_scale).contiguous() if copy_query else query
        scale = None if key_scale is None else key_scale.view(torch.uint8)
        w = weights if w_float else weights.float().contiguous()
        table, starts = as_table32(block_table), as_int(key_starts, int_dtype(key_starts))
        lq, lk = as_int(lq_tensor, lq_dtype), as_int(lk_tensor, lk_dtype)
        capacity = key.shape[1] * (table.shape[1] if paged else 1)
        indices = torch.empty(batch, s1, 1, k, dtype=torch.int32)     # sizes as ints, not a tuple: ~0.6 us less
        values = torch.empty(batch, s1, 1, k, dtype=torch.float32)
        ties = torch.empty(batch, s1, dtype=torch.int32)
        operands = (args, q.data_ptr(), w.data_ptr(), key.data_ptr(), 0 if paged else key.stride(0),
                    None if scale is None else scale.data_ptr(), 0 if scale is None or paged else scale.stride(0),
                    None if table is None else table.data_ptr(), None if lq is None else lq.data_ptr(),
                    None if lk is None else lk.data_ptr())
        status = entry(*operands, None if starts is None else starts.data_ptr(),
                       starts is not None and starts.dtype is torch.int64, capacity, torch.get_num_threads(),
                       indices.data_ptr(), values.data_ptr(), ties.data_ptr())
        if status == 0:
            return indices, values
        if status == _LI_PADDED:
            return None
        if status == _LI_TIES:
            status = _settle_ties(tied_scores, (*operands, capacity, torch.get_num_threads()), place_rows, ties,
                                  capacity, indices, values)
        if status == 0:
            return indices, values
        if status == _LI_NO_MEMORY:
            raise _out_of_memory(f"{batch} x {s1} rows of up to {capacity} keys, {heads} heads of dim {dim}")
        if status == _LI_BAD_KEY_SCALE:
            raise ValueError(f"lightning_indexer: a float8_e4m3fn `key` needs `key_scale` and a head dim D that is a "
                             f"multiple of 32 (got D={dim}); an int8 `key` needs `key_scale`")
        check_lengths(query, key, block_table, lq_tensor, lk_tensor)        # raises with the check's message
        raise ValueError(f"lightning_indexer: the native kernel refused the call's lengths or block table ({status})")

    return plan


def _settle_ties(tied_scores: Callable[..., int], operands: tuple, place_rows: Callable[..., None], ties: Tensor,
                 width: int, indices: Tensor, values: Tensor) -> int:
    """Rows whose k-th and (k+1)-th scores are equal (`ties`, li_call's flags), settled as torch.topk settles them in
    the score matrix an eager model masks: li_tied_scores (`tied_scores`, with the call's `operands`) scores them
    again into one [rows, width] matrix whose masked keys are -inf (width: the keys the layout holds), one topk
    keeps k of each, and li_place_rows (`place_rows`) writes them into the outputs. torch.topk's choice among equal
    scores depends on the row's length, so a row is as long as the eager model's, not as its visible keys (a
    left-padded row's padding, key_windows.leading_masked_keys, comes first as -inf). Returns the kernel's status
    (0: settled)."""
    k = indices.shape[3]
    matrix = torch.empty(ties.numel(), width)
    rows = torch.empty(ties.numel(), dtype=torch.int64)
    count = tied_scores(*operands, ties.data_ptr(), matrix.data_ptr(), rows.data_ptr())
    if count < 0:
        return -count
    scores, lead = matrix[:count], leading_masked_keys()
    if lead:                  # a left-padded row: its padding comes first in the eager model's row
        scores = torch.cat([scores.new_full((count, lead), float("-inf")), scores], dim=1)
    top = _TOPK(scores, k)
    positions = top.indices - lead if lead else top.indices       # a selected pad has value -inf: placed as -1
    place_rows(rows.data_ptr(), count, k, top.values.data_ptr(), positions.data_ptr(), indices.data_ptr(),
               values.data_ptr())
    return 0

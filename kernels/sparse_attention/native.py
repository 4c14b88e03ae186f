"""The native path of `ascend_dsa::sparse_flash_attention` (kernels/native/sparse_attention.c, built at first use
by kernels/native/loader.py): taken whenever it loads and the KV rows are float (fp32, bf16, fp16) with unit stride
along D. One call per batch covers all its query tokens: the kernel reads sparse_indices (and the block table) itself,
reads each selected row once, and folds a chunk of rows at a time into an online softmax for all heads (fp32; with
bf16 query, KV and output on an AVX512-BF16 CPU, bf16 dot products with fp32 sums: the logits are exact products,
and the probabilities are rounded to bf16 once for the weighted sum, as in the torch path). Tokens go one per
thread; a decode token's entries are split across the threads and the parts merged. Scaled fp8 KV that the query
tokens read over at least once is dequantized once per batch and handed to the kernel; in a decode step, each token's
selected fp8 rows are decoded natively (sfa_gather_e4m3) into a small fp32 buffer that the kernel reads instead."""
import ctypes
import functools

import torch
from torch import Tensor

from npu_graph.kernels.indexer.checks import visible_keys
from npu_graph.kernels.indexer.keys import KeyReader
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import prototypes as native_prototypes
from npu_graph.kernels.sparse_attention.torch_path import Readers, row_positions, same_tensor

NATIVE_SOURCE = "sparse_attention"   # kernels/native/sparse_attention.c
# A query token with at least this many selected entries has them split across the threads (fewer tokens than
# threads); below it the split's barriers cost more than the parallel work saves.
NATIVE_SPLIT_ROWS = 256


@functools.cache
def _typed_kernel(lib: ctypes.CDLL) -> tuple[ctypes._CFuncPtr, bool, bool]:
    """(the kernel's entry point with its C signature, whether the build reads fp16, whether it has bf16 dot
    products)."""
    has_f16 = native_prototypes.typed(lib, NATIVE_SOURCE, "sfa_has_f16")
    has_bf16_dot = native_prototypes.typed(lib, NATIVE_SOURCE, "sfa_has_bf16_dot")
    return native_prototypes.typed(lib, NATIVE_SOURCE, "sfa_attend"), bool(has_f16()), bool(has_bf16_dot())


def reads_f16() -> bool:
    """Whether the loaded build reads (and writes) fp16 values (F16C or the compiler's _Float16)."""
    loaded = native.load(NATIVE_SOURCE)
    return bool(loaded) and _typed_kernel(loaded.lib)[1]


def call_entry() -> ctypes._CFuncPtr:
    """sfa_call, the whole-call entry the plans use (kernels/sparse_attention/plan.py), of the library native_kernel
    loaded."""
    return _typed_call(native.load(NATIVE_SOURCE).lib)


@functools.cache
def _typed_call(lib: ctypes.CDLL) -> ctypes._CFuncPtr:
    return native_prototypes.typed(lib, NATIVE_SOURCE, "sfa_call")


def _row_major(x: Tensor | None, paged: bool) -> bool:
    """The kernel reads row r of a [B,S2,1,D] tensor at x[b].data_ptr() + r·stride(1) and of a paged cache at
    x.data_ptr() + r·stride(1): D contiguous, and a cache's blocks one after another."""
    if x is None:
        return True
    return x.device.type == "cpu" and x.stride(3) == 1 and (not paged or x.stride(0) == x.shape[1] * x.stride(1))


def native_kernel(key: Tensor, value: Tensor, key_rope: Tensor | None,
                   block_table: Tensor | None) -> ctypes._CFuncPtr | None:
    """The native kernel when it is loaded and reads these KV tensors (module docstring), else None."""
    loaded = native.load(NATIVE_SOURCE)
    codes = native.DTYPE_CODES
    if not loaded or key.dtype not in codes or (key_rope is not None and key_rope.dtype not in codes):
        return None
    fn, has_f16, _ = _typed_kernel(loaded.lib)
    if torch.float16 in (key.dtype, None if key_rope is None else key_rope.dtype) and not has_f16:
        return None
    paged = block_table is not None
    return fn if all(_row_major(x, paged) for x in (key, value, key_rope)) else None


def _rows_base(x: Tensor | None, b: int, paged: bool) -> tuple[int | None, int]:
    if x is None:
        return None, 0
    return (x.data_ptr() if paged else x[b].data_ptr()), x.stride(1)


def native_batch(kernel: ctypes._CFuncPtr, args: tuple, b: int, lq: int, lkv: int,
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
    v, v_stride = _rows_base(None if same_tensor(key, value) else value, b, paged)
    rope, rope_stride = _rows_base(key_rope, b, paged)
    n1, dl = q.shape[1:]
    ok = kernel(q.data_ptr(), None if q_rope is None else q_rope.data_ptr(), n1, dl,
                0 if q_rope is None else q_rope.shape[2], indices[b].data_ptr(), True, indices.stride(1),
                indices.shape[3], block, lq, lkv, mode == 3, 0, table[b].data_ptr() if paged else None, True,
                key.shape[1],
                kv, kv_stride, v, v_stride, rope, rope_stride, native.DTYPE_CODES[key.dtype],
                native.DTYPE_CODES[key.dtype if key_rope is None else key_rope.dtype], scale, bf16_dot,
                torch.get_num_threads(), NATIVE_SPLIT_ROWS, target.data_ptr(), softmax_max[b].data_ptr(),
                softmax_sum[b].data_ptr())
    if not direct:
        out[b, :lq] = target
    return bool(ok)


def rows_read(indices: Tensor, block: int, lq: int, lkv: int) -> int:
    """KV rows the first lq query tokens of a batch read in all, at most (each up to K·block of lkv)."""
    return lq * min(indices.shape[3] * block, lkv)


def native_dequantized(readers: Readers, args: tuple, b: int, lq: int, lkv: int,
                        outs: tuple[Tensor, Tensor, Tensor]) -> bool:
    """KV the kernel cannot read as stored (scaled fp8) whose rows the query tokens read at least once over in
    all (a prefill; a decode step over a short cache): batch b's visible rows dequantized once into fp32, then
    the native kernel over them. False when no native kernel reads them (the caller takes the torch path)."""
    keys = readers.key.float_range(b, 0, lkv)[None, :, None]
    values = keys if readers.value is None else readers.value.float_range(b, 0, lkv)[None, :, None]
    rope = None if readers.rope is None else readers.rope.float_range(b, 0, lkv)[None, :, None]
    kernel = native_kernel(keys, values, rope, None)
    if kernel is None:
        return False
    query, _, _, indices, scale, _, query_rope, _, block, mode = args
    rows = (query[b:b + 1], keys, values, indices[b:b + 1], scale, None,
            None if query_rope is None else query_rope[b:b + 1], rope, block, mode)
    return native_batch(kernel, rows, 0, lq, lkv, tuple(out[b:b + 1] for out in outs))


@functools.cache
def _typed_gather(lib: ctypes.CDLL) -> ctypes._CFuncPtr:
    return native_prototypes.typed(lib, NATIVE_SOURCE, "sfa_gather_e4m3")


def _e4m3_source(reader: KeyReader, b: int, positions: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """(codes [rows, D], scales [rows, tiles], slots) that sfa_gather_e4m3 reads for batch b's `positions`: a BSND
    tensor's batch b or a paged cache's blocks one after another; None when the rows are not scaled
    float8_e4m3fn codes with unit stride along D and along the scales."""
    codes, scales = reader.key, reader.scale
    if codes.dtype != torch.float8_e4m3fn or scales is None or scales.dtype != torch.float32 \
            or codes.stride(-1) != 1 or scales.stride(-1) != 1:
        return None
    if reader.table is None:
        return codes[b], scales[b], positions
    if codes.stride(0) != codes.shape[1] * codes.stride(1) or scales.stride(0) != scales.shape[1] * scales.stride(1):
        return None
    slots = reader.table[b, positions // reader.block] * reader.block + positions % reader.block
    return codes.flatten(0, 1), scales.flatten(0, 1), slots


def _gathered_rows(reader: KeyReader, b: int, positions: Tensor) -> Tensor:
    """The fp32 rows at `positions` in a contiguous [1,P,1,D] buffer: scaled fp8 codes decoded natively as they
    are gathered (sfa_gather_e4m3), other rows through the reader."""
    source = _e4m3_source(reader, b, positions)
    if source is None:
        return reader.float_rows(b, positions)[None, :, None]
    codes, scales, slots = source
    slots = slots.long().contiguous()
    out = torch.empty(slots.numel(), codes.shape[-1], dtype=torch.float32)
    _typed_gather(native.load(NATIVE_SOURCE).lib)(
        codes.data_ptr(), codes.stride(0), scales.data_ptr(), scales.stride(0), scales.shape[-1], slots.data_ptr(),
        slots.numel(), codes.shape[-1], out.data_ptr(), torch.get_num_threads())
    return out[None, :, None]


def native_gathered(readers: Readers, args: tuple, b: int, lq: int, lkv: int,
                    outs: tuple[Tensor, Tensor, Tensor]) -> bool:
    """KV the kernel cannot read as stored (scaled fp8) of a decode step: each query token's selected rows (its
    valid positions, as the torch path lists them, repeats kept) decoded into a small contiguous fp32 buffer
    (the torch path's values), and the native kernel over that buffer with identity indices and no causal limit
    (the listing applied it). False when no native kernel reads the buffer (the caller takes the torch path)."""
    query, _, _, indices, scale, _, query_rope, _, block, mode = args
    for t in range(lq):
        positions = row_positions(indices[b, t, 0], block, visible_keys(t, lq, lkv, mode))
        count = positions.numel()
        if count == 0:
            continue
        keys = _gathered_rows(readers.key, b, positions)
        values = keys if readers.value is None else _gathered_rows(readers.value, b, positions)
        rope = None if readers.rope is None else _gathered_rows(readers.rope, b, positions)
        kernel = native_kernel(keys, values, rope, None)
        identity = torch.arange(count, dtype=torch.long).view(1, 1, 1, count)
        rows = (query[b:b + 1, t:t + 1], keys, values, identity, scale, None,
                None if query_rope is None else query_rope[b:b + 1, t:t + 1], rope, 1, 0)
        if kernel is None or not native_batch(kernel, rows, 0, 1, count,
                                               tuple(out[b:b + 1, t:t + 1] for out in outs)):
            return False
    return True

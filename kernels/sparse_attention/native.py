"""The native path of `ascend_dsa::sparse_flash_attention` (kernels/native/sparse_attention.c, built at first use
by kernels/native/loader.py): taken whenever it loads and the KV rows are float (fp32, bf16, fp16) with unit stride
along D. One call per batch covers all its query tokens: the kernel reads sparse_indices (and the block table) itself,
reads each selected row once, and folds a chunk of rows at a time into an online softmax for all heads (fp32; with
bf16 query, KV and output on an AVX512-BF16 CPU, bf16 dot products with fp32 sums: the logits are exact products,
and the probabilities are rounded to bf16 once for the weighted sum, as in the torch path). Tokens go one per
thread; a decode token's entries are split across the threads and the parts merged. Scaled fp8 KV that the query
tokens read over at least once is dequantized once per batch and handed to the kernel."""
import ctypes
import functools

import torch
from torch import Tensor

from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import prototypes as native_prototypes
from npu_graph.kernels.sparse_attention.torch_path import Readers, same_tensor

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

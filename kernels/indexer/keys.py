"""Key rows for the torch paths of the indexer and sparse flash attention ops: MXFP8 and int8 dequantization, per-thread
scratch buffers reused across calls (large temporaries: gathered rows, fp32 copies), the skinny GEMM through
oneDNN where it is available, and `KeyReader`, which reads a batch's key rows by range or by position from a BSND
tensor or a paged cache."""
import functools
import math
import threading
from collections.abc import Callable

import torch
from torch import Tensor

from npu_graph.kernels.indexer.checks import MX_GROUP

ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_SCRATCH = threading.local()
_E4M3_F16_MASK = -16512   # int16 0xBF80: sign and the 7 magnitude bits of an e4m3 byte shifted left by 7


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
    """fp32 values of x; MXFP8 codes are multiplied by their per-32 group scale, int8 codes by their row's fp32
    scale."""
    if scale is None:
        return x.float()
    if x.dtype == torch.int8:
        return x.float().mul_(scale)
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
    return buf[:numel] if len(shape) == 1 else buf[:numel].view(shape)


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 products natively here: a CPU with AVX512-BF16, and oneDNN allowed to use it (a
    user's ONEDNN_MAX_CPU_ISA=AVX2 leaves the flag on the CPU but makes oneDNN refuse bf16 primitives), found by
    running one tiny product the first time a path asks."""
    if not (ONEDNN_LINEAR and torch.cpu._is_avx512_bf16_supported()):
        return False
    x = torch.ones(1, 32, dtype=torch.bfloat16)
    try:
        torch.ops.mkldnn._linear_pointwise(x, torch.ones(16, 32, dtype=torch.bfloat16), None, "none", [], "")
    except RuntimeError:
        return False
    return True


def _as_float(x: Tensor, name: str) -> Tensor:
    """x in fp32: x itself, or a copy in the scratch buffer `name`."""
    return x if x.dtype == torch.float32 else scratch(name, tuple(x.shape), torch.float32).copy_(x)


def linear(x: Tensor, w: Tensor, relu: bool = False) -> Tensor:
    """x @ w.T, optionally through a ReLU that keeps NaN (module docstring), with fp32 accumulation. oneDNN's linear
    is used where it is available (faster than the default GEMM for these skinny shapes on CPU, and bf16 inputs
    only round the result); otherwise torch.nn.functional.linear."""
    if ONEDNN_LINEAR and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and onednn_bf16())):
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

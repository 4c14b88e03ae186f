"""The bf16 decode-sized products of kernels/native/skinny_mm.c (`sm_gemv_bf16`): which operands it reads, their
shape class for kernels/native/dispatch.py, and the call plans that run it, for aten.mm and aten.bmm
(kernels/aten/skinny_mm.py and skinny_bmm.py decide per signature whether a call takes it).

x is bf16, [M, K] or [B, M, K] with 1..MAX_ROWS rows and unit stride along K; the weight is bf16, [K, N] or
[B, K, N], in either layout: unit stride along N (a [K, N] weight), or along K (the transposed view of an
[N, K] weight as a linear layer stores it, which the graph passes to mm: one dot product per output over a
contiguous weight row). Sums are fp32; the result is bf16 rounded to nearest even, as aten.mm rounds its fp32 sums,
so the two agree to bf16 rounding of sums that differ in their order.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch
from torch import Tensor

from npu_graph.kernels.native import dispatch
from npu_graph.kernels.native import prototypes as native_prototypes

NATIVE_SOURCE = "skinny_mm"
MAX_ROWS = 4            # the C source's MAX_ROWS
_BF16 = torch.bfloat16


@functools.cache
def kernel(lib: ctypes.CDLL) -> Callable[..., int]:
    """The library's sm_gemv_bf16, typed from its C declaration."""
    return native_prototypes.typed(lib, NATIVE_SOURCE, "sm_gemv_bf16")


def takes(x: Tensor, w: Tensor) -> bool:
    """Whether the kernel reads x @ w (module docstring); a mismatch of sizes is left to aten's own error."""
    dims = x.dim()
    if not (x.dtype is _BF16 and w.dtype is _BF16 and dims in (2, 3) and w.dim() == dims and x.is_cpu and w.is_cpu):
        return False
    if (x.requires_grad or w.requires_grad) and torch.is_grad_enabled():
        return False
    rows, inner, cols = x.shape[-2], x.shape[-1], w.shape[-1]
    return (0 < rows <= MAX_ROWS and inner > 0 and cols > 0 and w.shape[-2] == inner
            and (dims == 2 or (x.shape[0] == w.shape[0] and x.shape[0] > 0))
            and x.stride(-1) == 1 and (w.stride(-2) == 1 or w.stride(-1) == 1))


def rows_along_k(w: Tensor) -> bool:
    """Whether the kernel reads w as rows along K (dot products): unit stride along K."""
    return w.stride(-2) == 1


def shape_class(x: Tensor, w: Tensor, streamed: bool) -> tuple:
    """The dispatch class of a product `takes` accepts: bf16, the layout, batch, rows and sizes (bucketed)."""
    batch = x.shape[0] if x.dim() == 3 else 1
    return dispatch.shape_class("bf16", "nk" if rows_along_k(w) else "kn", batch, *x.shape[-2:], w.shape[-1],
                                "streamed" if streamed else "")


def _arguments(x: Tensor, w: Tensor) -> tuple[int, ...]:
    """sm_gemv_bf16's sizes and strides after x's pointer, up to w's (B, M, K, x_batch, ldx) and after w's
    pointer (w_batch, w_k, w_n, N)."""
    batched = x.dim() == 3
    return (x.shape[0] if batched else 1, x.shape[-2], x.shape[-1], x.stride(0) if batched else 0, x.stride(-2),
            w.stride(0) if batched else 0, w.stride(-2), w.stride(-1), w.shape[-1])


def plan(entry: Callable[..., int], x: Tensor, w: Tensor,
         fallback: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    """The native product for calls of x's and w's signature into a new bf16 tensor; a failed status falls back."""
    batch, rows, inner, x_batch, ldx, w_batch, w_k, w_n, cols = _arguments(x, w)
    shape = (batch, rows, cols) if x.dim() == 3 else (rows, cols)

    def run(x: Tensor, w: Tensor) -> Tensor:
        y = torch.empty(shape, dtype=_BF16, device="cpu")
        status = entry(x.data_ptr(), batch, rows, inner, x_batch, ldx, w.data_ptr(), w_batch, w_k, w_n, cols,
                       y.data_ptr(), rows * cols, cols)
        return y if not status else fallback(x, w)

    return run


def fits(out: Tensor, x: Tensor, w: Tensor) -> bool:
    """Whether the kernel can write x @ w straight into out: bf16 of the result's shape on the CPU, unit stride
    along N (rows and batches at any stride)."""
    shape = (*x.shape[:-1], w.shape[-1])
    return out.dtype is _BF16 and out.is_cpu and tuple(out.shape) == shape and out.stride(-1) == 1


def out_plan(entry: Callable[..., int], x: Tensor, w: Tensor,
             fallback: Callable[..., Tensor]) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """As `plan`, writing into the caller's out (`fits`; its strides are part of the signature)."""
    batch, rows, inner, x_batch, ldx, w_batch, w_k, w_n, cols = _arguments(x, w)

    def run(x: Tensor, w: Tensor, out: Tensor) -> Tensor:
        y_batch = out.stride(0) if out.dim() == 3 else 0
        status = entry(x.data_ptr(), batch, rows, inner, x_batch, ldx, w.data_ptr(), w_batch, w_k, w_n, cols,
                       out.data_ptr(), y_batch, out.stride(-2))
        return out if not status else fallback(x, w, out=out)

    return run

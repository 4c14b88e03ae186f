"""Decode-sized matrix products in the CPU runtime.

At decode a linear layer multiplies one row (a few rows, with batching) by its whole weight matrix, so its
time is the time to read the weights from memory. oneDNN / MKL read a [512, 512] fp32 weight from memory at
~11 GB/s for one row on this project's CPUs; native/skinny_mm.c streams each thread's contiguous share
of the weight rows at the memory bandwidth (~25 GB/s: 42 vs 101 us for 1 MB, and 1.3-2.4x at 4 rows).

When the runtime builds a CompiledGraph it binds the generated source's `torch.ops.aten.mm.default(...)` calls
to the native product (`bind`, as direct_calls binds the fused ops; the stored source and the cache keep the
aten form; ASCEND_DSA_NATIVE=0 is read then, not at every product).
`mm` takes the native kernel for fp32 CPU tensors with at most MAX_ROWS rows, unit stride along the reduced and
the output dims, and no autograd; everything else (and every product when the native library is not built or
ASCEND_DSA_NATIVE=0) goes to aten.mm unchanged. `linear` does the same for x @ w.T with a linear layer's
weight as stored (fused_moe's decode experts). The kernels sum in another order than a BLAS gemm: results
agree with aten.mm to fp32 rounding.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from npu_graph.kernels import dispatch, native, native_prototypes
from npu_graph.runtime.serial_calls import serial_when_small

NATIVE_SOURCE = "skinny_mm"
MAX_ROWS = 4            # measured: parity with MKL at 8 rows of a [512, 512] weight, 1.3-2.4x faster at 4
NAME = "_ascend_dsa_skinny_mm"
_CALL = "torch.ops.aten.mm.default("
_aten_mm = serial_when_small("mm.default", torch.ops.aten.mm.default)     # products it does not take
_F32 = torch.float32


@functools.cache
def _typed(lib: ctypes.CDLL) -> tuple[Callable[..., int], Callable[..., None]]:
    mm = native_prototypes.typed(lib, NATIVE_SOURCE, "sm_mm")
    return mm, native_prototypes.typed(lib, NATIVE_SOURCE, "sm_mm_nt")


def _takes(x: Tensor, w: Tensor, w_inner: int) -> bool:
    """Whether the kernel reads these operands: w's dim `w_inner` is the reduced one (0: x @ w, 1: x @ w.T) and
    must equal x's columns (else aten raises its own error); the kernel relies on every size checked here."""
    shape_x, shape_w = x.shape, w.shape
    return (x.dtype is _F32 and w.dtype is _F32 and len(shape_x) == 2 and len(shape_w) == 2
            and 0 < shape_x[0] <= MAX_ROWS and shape_x[1] > 0 and shape_w[0] > 0 and shape_w[1] > 0
            and shape_x[1] == shape_w[w_inner]
            and x.stride(1) == 1 and w.stride(1) == 1 and x.is_cpu and w.is_cpu
            and not ((x.requires_grad or w.requires_grad) and torch.is_grad_enabled()))


def _native_mm(kernel: Callable[..., int], x: Tensor, w: Tensor) -> Tensor:
    """x @ w through the native kernel where it applies and kernels/dispatch.py measured it faster, else aten.mm."""
    if not _takes(x, w, 0):
        return _aten_mm(x, w)

    def native_mm() -> Tensor:
        rows, inner = x.shape
        y = torch.empty(rows, w.shape[1], dtype=_F32, device="cpu")
        if kernel(x.data_ptr(), rows, inner, x.stride(0), w.data_ptr(), w.stride(0), w.shape[1], y.data_ptr()) == 0:
            return y
        return _aten_mm(x, w)

    cls = dispatch.shape_class(*x.shape, w.shape[1], w.stride(0) == w.shape[1])
    return dispatch.run("skinny_mm", NATIVE_SOURCE, cls, native_mm, lambda: _aten_mm(x, w))


def mm(x: Tensor, w: Tensor) -> Tensor:
    """x @ w for x [M, K] and w [K, N], through the native kernel where it applies (module docstring), else
    aten.mm."""
    loaded = native.load(NATIVE_SOURCE)
    return _native_mm(_typed(loaded.lib)[0], x, w) if loaded else _aten_mm(x, w)


def linear(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T for x [M, K] and a linear layer's weight w [N, K] (F.linear without bias), through the native
    kernel where it applies, else F.linear."""
    loaded = native.load(NATIVE_SOURCE)
    if not (loaded and _takes(x, w, 1)):
        return F.linear(x, w)

    def native_linear() -> Tensor:
        y = torch.empty(x.shape[0], w.shape[0], dtype=_F32, device="cpu")
        _typed(loaded.lib)[1](x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), w.data_ptr(), w.stride(0),
                              w.shape[0], y.data_ptr())
        return y

    cls = dispatch.shape_class(*x.shape, w.shape[0])
    return dispatch.run("skinny_linear", NATIVE_SOURCE, cls, native_linear, lambda: F.linear(x, w))


def native_callable() -> Callable[..., Any] | None:
    """What the CPU runtime binds this kernel's ATen calls to (runtime.direct_calls): the native entry, or None
    when the native library is not loaded (or ASCEND_DSA_NATIVE=0 when the graph is loaded)."""
    return native.native_entry(NATIVE_SOURCE, lambda lib: functools.partial(_native_mm, _typed(lib)[0]))

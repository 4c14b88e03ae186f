"""Decode-sized matrix products in the CPU runtime.

At decode a linear layer multiplies one row (a few rows, with batching) by its whole weight matrix, so its
time is the time to read the weights from memory. oneDNN / MKL read a [512, 512] fp32 weight from memory at
~11 GB/s for one row on this project's CPUs; native/skinny_mm.c streams each thread's contiguous share
of the weight rows at the memory bandwidth (~25 GB/s: 42 vs 101 us for 1 MB, and 1.3-2.4x at 4 rows).

When the runtime builds a CompiledGraph it binds the generated source's `torch.ops.aten.mm.default(...)` calls
to the native product (`bind`, as direct_calls binds the fused ops; the stored source and the cache keep the
aten form; ASCEND_DSA_NATIVE=0 is read then, not at every product).
`mm` takes the native kernel for fp32 CPU tensors with at most MAX_ROWS rows, unit stride along the reduced and
the output dims, and no autograd, and for bf16 ones with at most MAX_ROWS rows and a weight of unit stride along
either dim (kernels/aten/skinny_bf16.py: fp32 sums, the result rounded to bf16 as aten.mm rounds it; its shape
classes are apart from fp32's); everything else (and every product when the native library is not built or
ASCEND_DSA_NATIVE=0) goes to aten.mm unchanged. `linear` does the same for x @ w.T with a linear layer's
weight as stored (fused_moe's decode experts), bf16 included. The kernels sum in another order than a BLAS gemm: results
agree with aten.mm to fp32 rounding.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import profiler as autograd_profiler

from npu_graph.kernels.aten import skinny_bf16
from npu_graph.kernels.native import call_plans, dispatch
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import prototypes as native_prototypes
from npu_graph.runtime.serial_calls import serial_when_small

NATIVE_SOURCE = "skinny_mm"
MAX_ROWS = 4            # measured: parity with MKL at 8 rows of a [512, 512] weight, 1.3-2.4x faster at 4
NAME = "_ascend_dsa_skinny_mm"
_CALL = "torch.ops.aten.mm.default("
_aten_mm = serial_when_small("mm.default", torch.mm)     # products it does not take (aten.mm's binding: ~1 µs less)
_F32 = torch.float32


@functools.cache
def _typed(lib: ctypes.CDLL) -> tuple[Callable[..., int], Callable[..., None]]:
    mm = native_prototypes.typed(lib, NATIVE_SOURCE, "sm_mm")
    return mm, native_prototypes.typed(lib, NATIVE_SOURCE, "sm_mm_nt")


@functools.cache
def core_cache_bytes(sysfs: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The largest cache one core has to itself (its L2; sysfs), 1 MiB where sysfs does not say."""
    sizes = []
    for index in Path(sysfs).glob("index*"):
        try:
            level, size = (index / "level").read_text().strip(), (index / "size").read_text().strip()
        except OSError:
            continue
        if level == "2" and size[:-1].isdigit() and size[-1] in "KM":
            sizes.append(int(size[:-1]) << (10 if size[-1] == "K" else 20))
    return max(sizes, default=1 << 20)


def _span_bytes(w: Tensor) -> int:
    """Bytes from w's first element to its last (rows may be padded: stride(0) >= its row; any layout)."""
    return (sum((size - 1) * stride for size, stride in zip(w.shape, w.stride())) + 1) * w.element_size()


def _streamed(w: Tensor) -> bool:
    """Whether a decode step reads w from memory: a weight of half a core's own cache or more has left it by
    the time the next step comes back to it (every other layer's weights go through in between). Such
    products are measured with w evicted (kernels/native/dispatch.py `prepare`): there the native kernel streams
    memory faster than BLAS (1 MB: ~56 vs ~95 us on the 2-core EPYC VM), while on weights in cache the two are
    close and BLAS is ahead on the smaller ones."""
    return 2 * _span_bytes(w) >= core_cache_bytes()


def _evictor(lib: ctypes.CDLL, w: Tensor) -> Callable[[], object]:
    evict = native_prototypes.typed(lib, NATIVE_SOURCE, "sm_evict")
    return lambda: evict(w.data_ptr(), _span_bytes(w))


def _takes(x: Tensor, w: Tensor, w_inner: int) -> bool:
    """Whether the kernel reads these operands: w's dim `w_inner` is the reduced one (0: x @ w, 1: x @ w.T) and
    must equal x's columns (else aten raises its own error); the kernel relies on every size checked here."""
    shape_x, shape_w = x.shape, w.shape
    return (x.dtype is _F32 and w.dtype is _F32 and len(shape_x) == 2 and len(shape_w) == 2
            and 0 < shape_x[0] <= MAX_ROWS and shape_x[1] > 0 and shape_w[0] > 0 and shape_w[1] > 0
            and shape_x[1] == shape_w[w_inner]
            and x.stride(1) == 1 and w.stride(1) == 1 and x.is_cpu and w.is_cpu
            and not ((x.requires_grad or w.requires_grad) and torch.is_grad_enabled()))


def call_signature(x: Tensor, w: Tensor) -> tuple:
    """Everything `_takes` and a plan read (kernels/native/call_plans)."""
    return (x.shape, x.stride(), x.dtype, x.is_cpu, w.shape, w.stride(), w.dtype, w.is_cpu,
            (x.requires_grad or w.requires_grad) and torch.is_grad_enabled())


def _torch_mm(x: Tensor, w: Tensor) -> Tensor:
    return _aten_mm(x, w)


def _torch_linear(x: Tensor, w: Tensor) -> Tensor:
    return F.linear(x, w)


def _native_plan(kernel: Callable[..., int], x: Tensor, w: Tensor, w_inner: int) -> Callable[[Tensor, Tensor], Tensor]:
    """The native product for calls of x's and w's signature: sizes and strides fixed, one output allocation
    and the entry call (x @ w for w_inner 0, x @ w.T for 1); a failed status (sm_mm's) falls back to aten.mm."""
    rows, inner = x.shape
    x_stride, w_stride, cols = x.stride(0), w.stride(0), w.shape[1 - w_inner]

    def plan(x: Tensor, w: Tensor) -> Tensor:
        y = torch.empty(rows, cols, dtype=_F32, device="cpu")
        status = kernel(x.data_ptr(), rows, inner, x_stride, w.data_ptr(), w_stride, cols, y.data_ptr())
        return y if not status else _aten_mm(x, w)

    return plan


def _planned(plans: call_plans.Plans, signature: tuple, cls: tuple, native_plan: Callable[..., Tensor],
             torch_plan: Callable[..., Tensor]) -> Callable[..., Tensor] | None:
    """The plan of dispatch's choice for the class, stored for the signature; None until dispatch has a choice.
    (dispatch times `native_plan` itself, built before the measurement: a decode-sized product's plan costs ~1 us
    to build, a third of the call it plans, and timing it tipped the choice to torch.)"""
    impl = dispatch.known(plans.op, cls)
    if impl is None:
        return None
    plan = native_plan if impl == "native" else torch_plan
    plans.put(signature, plan)
    return plan


_MM_PLANS = call_plans.Plans("skinny_mm")
_LINEAR_PLANS = call_plans.Plans("skinny_linear")


def _native_mm(kernel: Callable[..., int], x: Tensor, w: Tensor) -> Tensor:
    """x @ w through the native kernel where it applies and kernels/native/dispatch.py measured it faster, else aten.mm:
    decided once per signature (kernels/native/call_plans)."""
    signature = call_signature(x, w)
    plan = _MM_PLANS.get(signature)
    if plan is not None:
        return plan(x, w)
    if not _takes(x, w, 0):
        if skinny_bf16.takes(x, w):
            return bf16_product("skinny_mm", _MM_PLANS, signature, x, w, _torch_mm)
        _MM_PLANS.put(signature, _torch_mm)
        return _aten_mm(x, w)
    streamed = _streamed(w)
    cls = dispatch.shape_class(*x.shape, w.shape[1], w.stride(0) == w.shape[1], "streamed" if streamed else "")
    plan = _native_plan(kernel, x, w, 0)
    result = dispatch.run("skinny_mm", NATIVE_SOURCE, cls, lambda: plan(x, w), lambda: _aten_mm(x, w),
                          _evictor(native.load(NATIVE_SOURCE).lib, w) if streamed else None)
    _planned(_MM_PLANS, signature, cls, plan, _torch_mm)
    return result


def bf16_product(op: str, plans: call_plans.Plans, signature: tuple, x: Tensor, w: Tensor,
                 torch_plan: Callable[[Tensor, Tensor], Tensor], read: Tensor | None = None) -> Tensor:
    """torch_plan(x, w) for bf16 operands, through kernels/aten/skinny_bf16.py's product of x and `read` (w as the
    kernel reads it, a [K, N] view of w's storage; w itself where not given: mm and bmm) where dispatch measured it
    faster for `op` (weights of half a core's cache or more evicted before each timed call), else torch_plan; the
    choice is stored as the signature's plan (a native plan reads only w's data pointer)."""
    lib = native.load(NATIVE_SOURCE).lib
    read = w if read is None else read
    streamed = _streamed(read)
    cls = skinny_bf16.shape_class(x, read, streamed)
    plan = skinny_bf16.plan(skinny_bf16.kernel(lib), x, read, torch_plan)
    result = dispatch.run(op, NATIVE_SOURCE, cls, lambda: plan(x, w), lambda: torch_plan(x, w),
                          _evictor(lib, w) if streamed else None)
    _planned(plans, signature, cls, plan, torch_plan)
    return result


_MM_OUT_PLANS = call_plans.Plans("skinny_mm")      # the op dispatch measures: its class choices are mm's
_aten_mm_out = serial_when_small("mm.default", torch.mm)       # torch.mm(x, w, out=...): the same work rule


def _torch_mm_out(x: Tensor, w: Tensor, out: Tensor) -> Tensor:
    return _aten_mm_out(x, w, out=out)


def _fits(out: Tensor, rows: int, cols: int) -> bool:
    """Whether the kernel can write x @ w straight into out: fp32 [rows, cols] on the CPU, rows one after another."""
    return (out.dtype is _F32 and out.is_cpu and tuple(out.shape) == (rows, cols) and out.stride(1) == 1
            and (rows == 1 or out.stride(0) == cols))


def _native_out_plan(kernel: Callable[..., int], x: Tensor, w: Tensor) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """As _native_plan for x @ w, writing into the caller's out (`_fits`)."""
    rows, inner = x.shape
    x_stride, w_stride, cols = x.stride(0), w.stride(0), w.shape[1]

    def plan(x: Tensor, w: Tensor, out: Tensor) -> Tensor:
        status = kernel(x.data_ptr(), rows, inner, x_stride, w.data_ptr(), w_stride, cols, out.data_ptr())
        return out if not status else _aten_mm_out(x, w, out=out)

    return plan


def _mm_out(kernel: Callable[..., int], x: Tensor, w: Tensor,
            out: Tensor) -> tuple[Tensor, Callable[..., Tensor] | None]:
    """x @ w into out, as `extern_kernels.mm(x, w, out=out)` in Inductor's generated code (runtime.inductor_glue):
    the native product where it applies and kernels/native/dispatch.py measured it faster (the class `_native_mm`
    measures), else torch.mm into out, on one thread when small; decided once per signature. Returns the result
    and the signature's plan (None while dispatch has no choice for its class)."""
    signature = (call_signature(x, w), out.shape, out.stride(), out.dtype, out.is_cpu)
    plan = _MM_OUT_PLANS.get(signature)
    if plan is not None:
        return plan(x, w, out), plan
    if skinny_bf16.takes(x, w) and skinny_bf16.fits(out, x, w):
        return _bf16_mm_out(signature, x, w, out)
    if not (_takes(x, w, 0) and _fits(out, x.shape[0], w.shape[1])):
        _MM_OUT_PLANS.put(signature, _torch_mm_out)
        return _aten_mm_out(x, w, out=out), _torch_mm_out
    streamed = _streamed(w)
    cls = dispatch.shape_class(*x.shape, w.shape[1], w.stride(0) == w.shape[1], "streamed" if streamed else "")
    plan = _native_out_plan(kernel, x, w)
    result = dispatch.run("skinny_mm", NATIVE_SOURCE, cls, lambda: plan(x, w, out), lambda: _aten_mm_out(x, w, out=out),
                          _evictor(native.load(NATIVE_SOURCE).lib, w) if streamed else None)
    return result, _planned(_MM_OUT_PLANS, signature, cls, plan, _torch_mm_out)


def _bf16_mm_out(signature: tuple, x: Tensor, w: Tensor, out: Tensor) -> tuple[Tensor, Callable[..., Tensor] | None]:
    """_mm_out for bf16 operands (kernels/aten/skinny_bf16.py), in the class bf16 `mm` measures."""
    lib = native.load(NATIVE_SOURCE).lib
    streamed = _streamed(w)
    cls = skinny_bf16.shape_class(x, w, streamed)
    plan = skinny_bf16.out_plan(skinny_bf16.kernel(lib), x, w, _aten_mm_out)
    result = dispatch.run("skinny_mm", NATIVE_SOURCE, cls, lambda: plan(x, w, out),
                          lambda: _aten_mm_out(x, w, out=out), _evictor(lib, w) if streamed else None)
    return result, _planned(_MM_OUT_PLANS, signature, cls, plan, _torch_mm_out)


class _SiteProduct:
    """One `extern_kernels.mm(x, w, out=...)` call site of an Inductor glue module, which calls it once per graph
    call: its last call's plan (`_mm_out`), kept with what may differ between the site's calls. Dynamo's guards
    fix a graph's input dtypes, devices, requires_grad and grad mode, and Inductor's code its buffers' dtypes, so
    a site's calls differ at most in sizes and strides (symbolic sizes) and in the native settings: those are its
    key, read at each call (~1 us, where the full signature and its lookup cost ~2.5 us, and the product itself
    2-3 us at decode sizes)."""

    __slots__ = ("_kernel", "_key", "_plan")

    def __init__(self, kernel: Callable[..., int]):
        self._kernel = kernel
        self._key: tuple | None = None
        self._plan: Callable[..., Tensor] | None = None

    def __call__(self, x: Tensor, w: Tensor, *, out: Tensor) -> Tensor:
        key = (call_plans.settings(), x.shape, x.stride(), w.shape, w.stride(), out.shape, out.stride())
        if key == self._key and not autograd_profiler._is_profiler_enabled:
            return self._plan(x, w, out)
        result, self._plan = _mm_out(self._kernel, x, w, out)
        self._key = key if self._plan is not None else None
        return result


def mm(x: Tensor, w: Tensor) -> Tensor:
    """x @ w for x [M, K] and w [K, N], through the native kernel where it applies (module docstring), else
    aten.mm."""
    loaded = native.load(NATIVE_SOURCE)
    return _native_mm(_typed(loaded.lib)[0], x, w) if loaded else _aten_mm(x, w)


def linear(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T for x [M, K] and a linear layer's weight w [N, K] (F.linear without bias), through the native
    kernel where it applies, else F.linear; decided once per signature (kernels/native/call_plans)."""
    signature = call_signature(x, w)
    plan = _LINEAR_PLANS.get(signature)
    if plan is not None:
        return plan(x, w)
    loaded = native.load(NATIVE_SOURCE)
    if loaded and w.dim() == 2 and skinny_bf16.takes(x, w.t()):
        return bf16_product("skinny_linear", _LINEAR_PLANS, signature, x, w, _torch_linear, w.t())
    if not (loaded and _takes(x, w, 1)):
        _LINEAR_PLANS.put(signature, _torch_linear)
        return F.linear(x, w)
    kernel, streamed = _typed(loaded.lib)[1], _streamed(w)
    cls = dispatch.shape_class(*x.shape, w.shape[0], "streamed" if streamed else "")
    plan = _native_plan(kernel, x, w, 1)
    result = dispatch.run("skinny_linear", NATIVE_SOURCE, cls, lambda: plan(x, w), lambda: F.linear(x, w),
                          _evictor(loaded.lib, w) if streamed else None)
    _planned(_LINEAR_PLANS, signature, cls, plan, _torch_linear)
    return result


def native_out_callable() -> Callable[..., Any]:
    """What the CPU runtime binds one call site of Inductor's `extern_kernels.mm(x, w, out=...)` to (a new object
    per call: `_SiteProduct`): the native product into out where the library is loaded, else torch.mm (one thread
    when small)."""
    return native.native_entry(NATIVE_SOURCE, lambda lib: _SiteProduct(_typed(lib)[0])) or _aten_mm_out


def native_callable() -> Callable[..., Any] | None:
    """What the CPU runtime binds this kernel's ATen calls to (runtime.direct_calls): the native entry, or None
    when the native library is not loaded (or ASCEND_DSA_NATIVE=0 when the graph is loaded)."""
    return native.native_entry(NATIVE_SOURCE, lambda lib: functools.partial(_native_mm, _typed(lib)[0]))

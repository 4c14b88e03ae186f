"""RMSNorm operators: `ascend_dsa::rms_norm` (mirrors `torch_npu.npu_rms_norm`) and `ascend_dsa::add_rms_norm`
(mirrors `torch_npu.npu_add_rms_norm`).

gamma covers the last gamma.dim() dimensions of x (usually just the hidden size); with those dimensions
flattened into one of size n:

    rstd = 1 / sqrt(sum(x^2) / n + epsilon)     fp32, shape of x with the normalized dimensions kept as 1
    y    = x * rstd * gamma                     computed in fp32, returned in x's dtype

add_rms_norm first forms the residual sum x = x1 + x2 in the input dtype (rounded like `x1 + x2` in
eager torch), returns it as the third output, and normalizes that rounded sum, so that
add_rms_norm(x1, x2, g) gives exactly rms_norm(x1 + x2, g): the fused op can replace the unfused pair
without changing numbers beyond rms_norm's own tolerance. gamma may be x's dtype or float32.

Non-finite values, as the unfused expression gives them on every path: a NaN in a row of x makes its rstd and y
NaN; an inf (and no NaN) makes its sum of squares inf, so rstd 0 and y 0 but NaN at the infinite values (inf · 0).
Finite rows whose sum of squares overflows fp32 (values beyond ~1e19) get rstd 0 too; whether a sum within
rounding of the fp32 maximum overflows depends on the order of additions, which differs between the paths. A
NaN or ±inf in gamma[i] reaches y[..., i] only (NaN where x · rstd is 0). add_rms_norm's sum follows IEEE
(inf + -inf is NaN) and is then normalized by this rule. A NaN epsilon is refused (it must be >= 0).

The CPU implementation is the native kernel (kernels/native/rms_norm.c: one pass for the sum of squares and
one for the output per row, rows split over threads for large inputs; add_rms_norm's sum formed and normalized
in the same pass) where kernels/native/dispatch.py measured it faster for the shape class, else torch: inputs of at
most FEW_ROWS_ELEMS values (decode rows) as the plain expression, larger ones in blocks of rows small enough to
stay in cache, so the fp32 copy of a bf16/fp16 input and the products exist one block at a time. Measured on an
AMD EPYC (Zen 4, 2 cores), fp32: a decode row ~22 -> ~6 us; a 512 x 64 prefill block 59 -> ~8 us.
"""
import ctypes
import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from npu_graph.kernels.checks import (
    once_per_signature,
    require,
    require_dtype,
    require_same,
    static_checks_needed,
    tensors_given,
)
from npu_graph.kernels.native import call_plans, dispatch
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import prototypes as native_prototypes

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHUNK_ELEMS = 1 << 20
# Inputs up to this size (a few decode rows) skip the blocked loop: its set-up costs more than the math.
FEW_ROWS_ELEMS = 1 << 13
NATIVE_SOURCE = "rms_norm"


def _rstd_shape(x_shape: torch.Size, gamma_dim: int) -> list[int]:
    return [*x_shape[:len(x_shape) - gamma_dim], *([1] * gamma_dim)]


@once_per_signature
def _check(op: str, x: Tensor, gamma: Tensor, epsilon: float, x_name: str = "x") -> None:
    require_dtype(op, x_name, x, FLOAT_DTYPES)
    require_dtype(op, "gamma", gamma, dict.fromkeys((x.dtype, torch.float32)))
    require(1 <= gamma.dim() <= x.dim(), f"{op}: `gamma` must have rank 1..{x.dim()} (the normalized trailing "
                                         f"dimensions of `{x_name}`), got shape {tuple(gamma.shape)}")
    require(tuple(x.shape[x.dim() - gamma.dim():]) == tuple(gamma.shape),
            f"{op}: `gamma` of shape {tuple(gamma.shape)} must equal the trailing dimensions of `{x_name}` "
            f"{tuple(x.shape)}")
    require(gamma.numel() > 0, f"{op}: `gamma` of shape {tuple(gamma.shape)} is empty; there is nothing to normalize")
    require(epsilon >= 0, f"{op}: `epsilon` must be >= 0, got {epsilon}")


def _norm_rows(xc: Tensor, gamma: Tensor, epsilon: float, y: Tensor, rstd: Tensor) -> None:
    """Normalize the rows of one block xc [r, n] into y [r, n] (x's dtype) and rstd [r, 1] (fp32)."""
    xf = xc.float()
    sum_sq = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_()
    torch.rsqrt(sum_sq.div_(xc.shape[-1]).add_(epsilon), out=rstd)
    if y.dtype == torch.float32:
        torch.mul(xf, rstd, out=y)
        y.mul_(gamma)
    else:
        y.copy_(xf.mul_(rstd).mul_(gamma))


def _row_blocks(rows: int, n: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_ELEMS // max(1, n))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


@functools.cache
def _typed(lib: ctypes.CDLL) -> tuple[Callable[..., None], Callable[..., None], bool]:
    has_f16 = native_prototypes.typed(lib, NATIVE_SOURCE, "rn_has_f16")
    return (native_prototypes.typed(lib, NATIVE_SOURCE, "rn_rows"),
            native_prototypes.typed(lib, NATIVE_SOURCE, "rn_add_rows"), bool(has_f16()))


def _native_kernels(*tensors: Tensor) -> tuple[Callable[..., None], Callable[..., None]] | None:
    """The native kernels (rows, add-then-rows) when the library is loaded and takes every tensor's dtype, on the
    CPU, else None."""
    loaded = native.load(NATIVE_SOURCE)
    if not loaded or any(t.dtype not in native.DTYPE_CODES or not t.is_cpu for t in tensors):
        return None
    rows, add_rows, has_f16 = _typed(loaded.lib)
    return None if tensors[0].dtype == torch.float16 and not has_f16 else (rows, add_rows)


def _row_stride(x: Tensor, gamma_dim: int) -> int | None:
    """The stride between x's rows (its last gamma_dim dims) when each row is contiguous and the rows are evenly
    spaced (a slice of a wider tensor's last dimension, say), else None: what the native rows kernel reads in
    place. From sizes and strides alone (fake tensors of any mode ask too)."""
    sizes, strides, lead = x.shape, x.stride(), x.dim() - gamma_dim
    n = math.prod(sizes[lead:])
    if x.is_contiguous():
        return n
    expected = 1
    for size, stride in zip(reversed(sizes[lead:]), reversed(strides[lead:])):
        if size != 1 and stride != expected:
            return None
        expected *= size
    row, span = None, 1
    for size, stride in zip(reversed(sizes[:lead]), reversed(strides[:lead])):
        if size == 1:
            continue
        if row is not None and stride != row * span:
            return None
        row, span = (stride, size) if row is None else (row, span * size)
    return n if row is None else row


def _native_plan(fn: Callable[..., None], x: Tensor, gamma: Tensor) -> Callable[..., tuple[Tensor, Tensor]]:
    """The native kernel's result (module docstring) for calls of x's and gamma's signature (x's rows evenly
    spaced: `_row_stride`): sizes, dtype code and rstd's shape fixed, gamma passed as it is when it is contiguous
    fp32."""
    n, code, rstd_shape, gamma_of = _native_settings(x, gamma)
    shape, dtype, rows, x_stride = x.shape, x.dtype, x.numel() // n, _row_stride(x, gamma.dim())

    def plan(x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
        g = gamma_of(gamma)
        y, rstd = torch.empty(shape, dtype=dtype), torch.empty(rstd_shape, dtype=torch.float32)
        fn(x.data_ptr(), code, rows, n, x_stride, g.data_ptr(), epsilon, y.data_ptr(), rstd.data_ptr())
        return y, rstd

    return plan


def _native_add_plan(fn: Callable[..., None], x1: Tensor, gamma: Tensor) -> Callable[..., tuple[Tensor, ...]]:
    """As _native_plan for add_rms_norm: the kernel writes the rounded sum x as well."""
    n, code, rstd_shape, gamma_of = _native_settings(x1, gamma)

    def plan(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor, Tensor]:
        g = gamma_of(gamma)
        x, y = torch.empty_like(x1), torch.empty_like(x1)
        rstd = torch.empty(rstd_shape, dtype=torch.float32)
        fn(x1.data_ptr(), x2.data_ptr(), code, x1.numel() // n, n, g.data_ptr(), epsilon, x.data_ptr(),
           y.data_ptr(), rstd.data_ptr())
        return y, rstd, x

    return plan


def _native_settings(x: Tensor, gamma: Tensor) -> tuple[int, int, list[int], Callable[[Tensor], Tensor]]:
    """What a native plan fixes for x's signature: n, the dtype code, rstd's shape and how gamma becomes the
    kernel's contiguous fp32 [n] (as it is when it already is one)."""
    n = gamma.numel()
    as_is = gamma.dtype == torch.float32 and gamma.is_contiguous()
    return (n, native.DTYPE_CODES[x.dtype], _rstd_shape(x.shape, gamma.dim()),
            (lambda g: g) if as_is else (lambda g: g.float().reshape(n).contiguous()))


def _torch_few_rows(x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """`_norm_rows`' arithmetic in fewer calls, without blocks or output buffers."""
    n = gamma.numel()
    rows = x.reshape(-1, n).float()
    rstd = torch.linalg.vector_norm(rows, dim=-1, keepdim=True).square_().div_(n).add_(epsilon).rsqrt_()
    y = (rows * rstd).mul_(gamma.float().reshape(n)).to(x.dtype)
    return y.view(x.shape), rstd.view(_rstd_shape(x.shape, gamma.dim()))


def _torch_blocks(x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """Blocks of rows small enough to stay in cache (module docstring)."""
    n = gamma.numel()
    rows = x.contiguous().view(-1, n)
    gf = gamma.float().reshape(n)
    y = torch.empty_like(rows)
    rstd = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
    for start, stop in _row_blocks(rows.shape[0], n):
        _norm_rows(rows[start:stop], gf, epsilon, y[start:stop], rstd[start:stop])
    return y.view(x.shape), rstd.view(_rstd_shape(x.shape, gamma.dim()))


def _torch_rows(x: Tensor) -> Callable[..., tuple[Tensor, Tensor]]:
    """The torch path for x's size: the plain expression for a few rows, else the blocks."""
    return _torch_few_rows if x.numel() <= FEW_ROWS_ELEMS else _torch_blocks


def _add_then(norm: Callable[..., tuple[Tensor, Tensor]]) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """x1 + x2 into a new contiguous tensor, then `norm` of it: rms_norm's path, or its plan for the sum."""
    def add_then_norm(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor, Tensor]:
        x = torch.add(x1, x2, out=x1.new_empty(x1.shape))     # contiguous whatever the inputs' layouts
        return (*norm(x, gamma, epsilon), x)
    return add_then_norm


def native_class(x: Tensor, gamma: Tensor, *args: object, **kwargs: object) -> tuple | None:
    """The shape class kernels/native/dispatch.py measures for rows the native kernel reads, else None."""
    if _native_kernels(x) is None or _row_stride(x, gamma.dim()) is None:
        return None
    return _shape_class(x, gamma)


def add_native_class(x1: Tensor, x2: Tensor, gamma: Tensor, *args: object, **kwargs: object) -> tuple | None:
    """native_class for add_rms_norm, whose kernel reads both summands contiguous."""
    if _native_kernels(x1, x2) is None or not (x1.is_contiguous() and x2.is_contiguous()):
        return None
    return _shape_class(x1, gamma)


def _shape_class(x: Tensor, gamma: Tensor) -> tuple:
    return dispatch.shape_class(x.dtype, x.numel() // max(1, gamma.numel()), gamma.numel())


def _signature(x: Tensor, gamma: Tensor) -> tuple:
    """Everything a call's path is decided from (kernels/native/call_plans)."""
    return x.shape, x.stride(), x.dtype, x.is_cpu, gamma.shape, gamma.stride(), gamma.dtype


_PLANS = call_plans.Plans("rms_norm")
_ADD_PLANS = call_plans.Plans("add_rms_norm")


def _planned(op: str, plans: call_plans.Plans, signature: tuple, cls: tuple | None, native_plan: Callable | None,
             torch_plan: Callable, args: tuple) -> tuple[Tensor, ...]:
    """The native plan or the torch one, whichever kernels/native/dispatch.py measured faster for the shape class (the
    torch one where there is no native plan); stores the plan of the choice for `signature`."""
    if native_plan is None:
        plans.put(signature, torch_plan)
        return torch_plan(*args)
    result = dispatch.run(op, NATIVE_SOURCE, cls, lambda: native_plan(*args), lambda: torch_plan(*args))
    impl = dispatch.known(op, cls)
    if impl is not None:
        plans.put(signature, native_plan if impl == "native" else torch_plan)
    return result


def _rms_norm_rows(x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    signature = _signature(x, gamma)
    plan = _PLANS.get(signature)
    if plan is not None:
        return plan(x, gamma, epsilon)
    kernels = _native_kernels(x)
    native_plan = (None if kernels is None or _row_stride(x, gamma.dim()) is None
                   else _native_plan(kernels[0], x, gamma))
    return _planned("rms_norm", _PLANS, signature, _shape_class(x, gamma), native_plan, _torch_rows(x),
                    (x, gamma, epsilon))


def _add_rms_norm_rows(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor, Tensor]:
    """The fused native kernel only for a class whose rms_norm runs natively, so that add_rms_norm(x1, x2) stays
    exactly rms_norm(x1 + x2) whichever path each takes: the kernel sums squares in rms_norm's order. Elsewhere
    the sum, then rms_norm's path."""
    signature = (x1.shape, x1.stride(), x2.stride(), x1.dtype, x2.dtype, x1.is_cpu, gamma.shape, gamma.stride(),
                 gamma.dtype)
    plan = _ADD_PLANS.get(signature)
    if plan is not None:
        return plan(x1, x2, gamma, epsilon)
    result = _add_then(_rms_norm_rows)(x1, x2, gamma, epsilon)        # measures rms_norm's class first
    norm_plan = _PLANS.get(_signature(result[2], gamma))                # the sum's plan, once rms_norm has one
    if norm_plan is None:
        return result
    cls = _shape_class(x1, gamma)
    kernels = _native_kernels(x1, x2) if x1.is_contiguous() and x2.is_contiguous() else None
    if kernels is None or dispatch.known("rms_norm", cls) != "native":
        _ADD_PLANS.put(signature, _add_then(norm_plan))
        return result
    return _planned("add_rms_norm", _ADD_PLANS, signature, cls, _native_add_plan(kernels[1], x1, gamma),
                    _add_then(norm_plan), (x1, x2, gamma, epsilon))


@torch.library.custom_op("ascend_dsa::rms_norm", mutates_args=())
@tensors_given
def rms_norm(x: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """RMSNorm over gamma's trailing dimensions: returns (y in x's dtype, rstd fp32 with those dims as 1)."""
    if static_checks_needed():
        _check("rms_norm", x, gamma, epsilon)
    return _rms_norm_rows(x, gamma, epsilon)


@rms_norm.register_fake
def _(x: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    _check("rms_norm", x, gamma, epsilon)
    return x.new_empty(x.shape), x.new_empty(_rstd_shape(x.shape, gamma.dim()), dtype=torch.float32)


def reference_rms_norm(x: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """The formula in fp32, reducing over gamma's dimensions."""
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).sum(dims, keepdim=True) / math.prod(gamma.shape) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def _check_add(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float) -> None:
    _check("add_rms_norm", x1, gamma, epsilon, "x1")
    require_same("add_rms_norm", "dtypes of `x1` and `x2`", x1.dtype, x2.dtype)
    require_same("add_rms_norm", "shapes of `x1` and `x2`", tuple(x1.shape), tuple(x2.shape))


@torch.library.custom_op("ascend_dsa::add_rms_norm", mutates_args=())
@tensors_given
def add_rms_norm(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """x = x1 + x2, then RMSNorm of x: returns (y, rstd, x)."""
    if static_checks_needed():
        _check_add(x1, x2, gamma, epsilon)
    return _add_rms_norm_rows(x1, x2, gamma, epsilon)


@add_rms_norm.register_fake
def _(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    _check_add(x1, x2, gamma, epsilon)
    rstd = x1.new_empty(_rstd_shape(x1.shape, gamma.dim()), dtype=torch.float32)
    return x1.new_empty(x1.shape), rstd, x1.new_empty(x1.shape)      # contiguous, as the CPU paths return


def reference_add_rms_norm(x1: Tensor, x2: Tensor, gamma: Tensor,
                           epsilon: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """x = x1 + x2 in the input dtype, then reference_rms_norm(x)."""
    x = x1 + x2
    y, rstd = reference_rms_norm(x, gamma, epsilon)
    return y, rstd, x

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

The CPU implementation walks blocks of rows small enough to stay in cache, so the fp32 copy of a
bf16/fp16 input and the products exist one block at a time, never for the whole tensor; inputs of at most
FEW_ROWS_ELEMS values (decode rows) go to a native kernel (kernels/native/rms_norm.c: one pass for the sum of
squares and one for the output, ~22 -> ~6 us a call) or, without it, to the plain expression, which costs fewer
calls than the blocks.
"""
import ctypes
import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from npu_graph.kernels import call_plans, dispatch, native, native_prototypes
from npu_graph.kernels.checks import once_per_signature, require, require_dtype, require_same, static_checks_needed

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHUNK_ELEMS = 1 << 20
# Inputs up to this size (a few decode rows) skip the blocked loop: its set-up costs more than the math.
FEW_ROWS_ELEMS = 1 << 13
NATIVE_SOURCE = "rms_norm"


def _rstd_shape(x_shape: torch.Size, gamma_dim: int) -> list[int]:
    return [*x_shape[:len(x_shape) - gamma_dim], *([1] * gamma_dim)]


@once_per_signature
def _check(op: str, x: Tensor, gamma: Tensor, epsilon: float) -> None:
    require_dtype(op, "x", x, FLOAT_DTYPES)
    require_dtype(op, "gamma", gamma, dict.fromkeys((x.dtype, torch.float32)))
    require(1 <= gamma.dim() <= x.dim(), f"{op}: `gamma` must have rank 1..{x.dim()} (the normalized trailing "
                                         f"dimensions of x), got shape {tuple(gamma.shape)}")
    require(tuple(x.shape[x.dim() - gamma.dim():]) == tuple(gamma.shape),
            f"{op}: `gamma` of shape {tuple(gamma.shape)} must equal the trailing dimensions of x "
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
def _typed(lib: ctypes.CDLL) -> tuple[Callable[..., None], bool]:
    has_f16 = native_prototypes.typed(lib, NATIVE_SOURCE, "rn_has_f16")
    return native_prototypes.typed(lib, NATIVE_SOURCE, "rn_rows"), bool(has_f16())


def _native_kernel(x: Tensor) -> Callable[..., None] | None:
    """The native kernel when it is loaded and reads x (contiguous CPU rows of a dtype it takes), else None."""
    loaded = native.load(NATIVE_SOURCE)
    if not loaded or x.dtype not in native.DTYPE_CODES or not x.is_cpu or not x.is_contiguous():
        return None
    fn, has_f16 = _typed(loaded.lib)
    return None if x.dtype == torch.float16 and not has_f16 else fn


def _native_plan(fn: Callable[..., None], x: Tensor, gamma: Tensor) -> Callable[..., tuple[Tensor, Tensor]]:
    """The native kernel's result (module docstring) for calls of x's and gamma's signature: sizes, dtype code
    and rstd's shape fixed, gamma passed as it is when it is contiguous fp32."""
    n = gamma.numel()
    rows, code, rstd_shape = x.numel() // n if n else 0, native.DTYPE_CODES[x.dtype], _rstd_shape(x.shape, gamma.dim())
    gamma_as_is = gamma.dtype == torch.float32 and gamma.is_contiguous()

    def plan(x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
        g = gamma if gamma_as_is else gamma.float().reshape(n).contiguous()
        y, rstd = torch.empty_like(x), torch.empty(rstd_shape, dtype=torch.float32, device="cpu")
        fn(x.data_ptr(), code, rows, n, g.data_ptr(), epsilon, y.data_ptr(), rstd.data_ptr())
        return y, rstd

    return plan


def _torch_few_rows(x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """`_norm_rows`' arithmetic in fewer calls, without blocks or output buffers."""
    n = gamma.numel()
    rows = x.reshape(-1, n).float()
    rstd = torch.linalg.vector_norm(rows, dim=-1, keepdim=True).square_().div_(n).add_(epsilon).rsqrt_()
    y = (rows * rstd).mul_(gamma.float().reshape(n)).to(x.dtype)
    return y.view(x.shape), rstd.view(_rstd_shape(x.shape, gamma.dim()))


def native_class(x: Tensor, gamma: Tensor, *args: object, **kwargs: object) -> tuple | None:
    """The shape class kernels/dispatch.py measures for decode rows the native kernel reads, else None (also for
    add_rms_norm, whose sum x1 + x2 has x1's shape and dtype)."""
    if x.numel() > FEW_ROWS_ELEMS or _native_kernel(x) is None:
        return None
    return _shape_class(x, gamma)


def _shape_class(x: Tensor, gamma: Tensor) -> tuple:
    return dispatch.shape_class(x.dtype, x.numel() // max(1, gamma.numel()), gamma.numel())


def _signature(x: Tensor, gamma: Tensor) -> tuple:
    """Everything the few-rows path decides from (kernels/call_plans)."""
    return x.shape, x.stride(), x.dtype, x.is_cpu, gamma.shape, gamma.stride(), gamma.dtype


_PLANS = call_plans.Plans("rms_norm")
_ADD_PLANS = call_plans.Plans("add_rms_norm")


def _rms_norm_few_rows(x: Tensor, gamma: Tensor, epsilon: float, signature: tuple) -> tuple[Tensor, Tensor]:
    """A handful of rows (decode): the native kernel or the torch arithmetic, whichever kernels/dispatch.py
    measured faster for this shape class; stores the plan of the choice for x's and gamma's `signature`."""
    fn = _native_kernel(x)
    if fn is None:
        _PLANS.put(signature, _torch_few_rows)
        return _torch_few_rows(x, gamma, epsilon)
    cls, native_plan = _shape_class(x, gamma), _native_plan(fn, x, gamma)     # timed as a planned call runs
    result = dispatch.run("rms_norm", NATIVE_SOURCE, cls, lambda: native_plan(x, gamma, epsilon),
                          lambda: _torch_few_rows(x, gamma, epsilon))
    impl = dispatch.known("rms_norm", cls)
    if impl is not None:
        _PLANS.put(signature, native_plan if impl == "native" else _torch_few_rows)
    return result


def _rms_norm_rows(x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    n = gamma.numel()
    if x.numel() <= FEW_ROWS_ELEMS:
        signature = _signature(x, gamma)
        plan = _PLANS.get(signature)
        return plan(x, gamma, epsilon) if plan is not None else _rms_norm_few_rows(x, gamma, epsilon, signature)
    rows = x.contiguous().view(-1, n)
    gf = gamma.float().reshape(n)
    y = torch.empty_like(rows)
    rstd = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
    for start, stop in _row_blocks(rows.shape[0], n):
        _norm_rows(rows[start:stop], gf, epsilon, y[start:stop], rstd[start:stop])
    return y.view(x.shape), rstd.view(_rstd_shape(x.shape, gamma.dim()))


@torch.library.custom_op("ascend_dsa::rms_norm", mutates_args=())
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
    _check("add_rms_norm", x1, gamma, epsilon)
    require_same("add_rms_norm", "dtypes of `x1` and `x2`", x1.dtype, x2.dtype)
    require_same("add_rms_norm", "shapes of `x1` and `x2`", tuple(x1.shape), tuple(x2.shape))


def _add_few_rows(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float,
                  signature: tuple) -> tuple[Tensor, Tensor, Tensor]:
    """x1 + x2 into a new contiguous tensor, then the few-rows rms_norm of it; stores the plan for `signature`
    once rms_norm has one for the sum's."""
    x = torch.add(x1, x2, out=x1.new_empty(x1.shape))     # contiguous whatever the inputs' layouts
    x_signature = _signature(x, gamma)
    y, rstd = _rms_norm_rows(x, gamma, epsilon)
    norm = _PLANS.get(x_signature)
    if norm is not None:
        def plan(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor, Tensor]:
            x = torch.add(x1, x2, out=x1.new_empty(x1.shape))
            return (*norm(x, gamma, epsilon), x)
        _ADD_PLANS.put(signature, plan)
    return y, rstd, x


@torch.library.custom_op("ascend_dsa::add_rms_norm", mutates_args=())
def add_rms_norm(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """x = x1 + x2, then RMSNorm of x: returns (y, rstd, x)."""
    if static_checks_needed():
        _check_add(x1, x2, gamma, epsilon)
    if x1.numel() <= FEW_ROWS_ELEMS:
        signature = (x1.shape, x1.stride(), x2.stride(), x1.dtype, x2.dtype, x1.is_cpu, gamma.shape, gamma.stride(),
                     gamma.dtype)
        plan = _ADD_PLANS.get(signature)
        return plan(x1, x2, gamma, epsilon) if plan is not None else _add_few_rows(x1, x2, gamma, epsilon, signature)
    n = gamma.numel()
    a, b = x1.contiguous().view(-1, n), x2.contiguous().view(-1, n)
    gf = gamma.float().reshape(n)
    x, y = torch.empty_like(a), torch.empty_like(a)
    rstd = torch.empty(a.shape[0], 1, dtype=torch.float32, device=a.device)
    for start, stop in _row_blocks(a.shape[0], n):
        rows = torch.add(a[start:stop], b[start:stop], out=x[start:stop])
        _norm_rows(rows, gf, epsilon, y[start:stop], rstd[start:stop])
    return y.view(x1.shape), rstd.view(_rstd_shape(x1.shape, gamma.dim())), x.view(x1.shape)


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

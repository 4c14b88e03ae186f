"""`ascend_dsa::rotary_mul` — rotary position embedding (RoPE) applied in one op, mirroring
`torch_npu.npu_rotary_mul(input, r1, r2, rotary_mode="half")` (torch_npu 7.3.0):

    output = r1 · input + r2 · rotate(input)
    rotate(x) = cat(−x2, x1)  with x1, x2 = chunk(x, 2, −1)                 rotary_mode="half"
    rotate(x) = (−x1, x0, −x3, x2, ...)  pairs (x0, x1), (x2, x3), ...    rotary_mode="interleave"

input is 4-D ([B,S,N,D], [B,N,S,D] or [S,B,N,D]) with an even D; r1 and r2 (the cosines and sines, each angle
written for both members of its pair) are 4-D and broadcast to input without enlarging it. All three share
one float dtype; the output has input's shape, dtype and memory layout (as `torch.empty_like(input)`: an
elementwise op keeps a dense input's dim order, e.g. a transposed query stays transposed).

Non-finite values. Each output value is r1 · x + r2 · (±partner) in IEEE arithmetic, as the unfused eager
expression computes it on every path: a NaN or ±inf in input reaches its own output and its pair partner's, one
in r1 or r2 the outputs it multiplies (broadcast), with inf · 0 and inf − inf giving NaN. bf16 and fp16 products
and sums round in that dtype, as eager's do, so where a sum comes within rounding of the dtype's largest value
whether it overflows can differ from the definition's single rounding of the fp32 result.

The CPU implementation does the arithmetic of the unfused form in the same order, one rounding per
multiplication and one per addition in input's dtype, so its result equals eager
`x1·cos − x2·sin, x2·cos + x1·sin` bit for bit. fp32 and bf16 calls take the native kernel
kernels/native/rotary_mul.c (one pass over input, a vector at a time where the last dim is contiguous, rows split
over threads for large calls), where kernels/native/dispatch.py measured it faster; at S=2048, 16 heads × 64 it
takes a few milliseconds where the torch path's products, sums and copies took ~48. The torch path (fp16, no C
compiler, or measured faster): a few rows (decode), gather the pair members swapped (one index_select with a
cached order), multiply by r2 with the first member's sign flipped (−a·s == a·(−s) exactly), add input · r1;
more rows, both halves of the pairs computed into views of the output.
"""
import ctypes
import functools
from collections.abc import Callable

import torch
from torch import Tensor

from npu_graph.kernels.checks import (
    once_per_signature,
    require,
    require_choice,
    require_dtype,
    require_rank,
    require_same,
    static_checks_needed,
    tensors_given,
)
from npu_graph.kernels.native import call_plans, dispatch
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import prototypes as native_prototypes

OP = "rotary_mul"
MODES = ("half", "interleave")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Up to this many values (decode rows) one gather of the swapped pairs beats the per-half products; above it
# the gather along the last dim is the slower (measured 11.5 vs 29 us at 16x64, 114 vs 59 us at 64x16x64).
FEW_ELEMS = 1 << 12
NATIVE_SOURCE = "rotary_mul"
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@once_per_signature
def _check(input: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str) -> None:
    require_choice(OP, "rotary_mode", rotary_mode, MODES)
    for name, t in (("input", input), ("r1", r1), ("r2", r2)):
        require_rank(OP, name, t, 4)
        require_dtype(OP, name, t, FLOAT_DTYPES)
    require_same(OP, "dtypes of `r1` and `input`", r1.dtype, input.dtype)
    require_same(OP, "dtypes of `r2` and `input`", r2.dtype, input.dtype)
    require(input.shape[-1] % 2 == 0, f"{OP}: the last dim D={input.shape[-1]} of `input` must be even "
                                      f"(RoPE rotates pairs of values)")
    for name, t in (("r1", r1), ("r2", r2)):
        fits = all(r == 1 or r == x for r, x in zip(t.shape, input.shape))
        require(fits, f"{OP}: `{name}` of shape {tuple(t.shape)} does not broadcast to `input` of shape "
                      f"{tuple(input.shape)} (each dim must be 1 or equal to input's)")


@functools.cache
def _swap(d: int, rotary_mode: str, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """(order, sign): rotate(x) == x[..., order] · sign, for the last dim d of the given mode (cached)."""
    half = d // 2
    if rotary_mode == "half":
        order = torch.cat((torch.arange(half, d), torch.arange(half)))
        sign = torch.cat((-torch.ones(half), torch.ones(half)))
    else:
        order = torch.arange(d).view(half, 2).flip(-1).flatten()
        sign = torch.tensor([-1.0, 1.0]).repeat(half)
    return order.to(device), sign.to(dtype=dtype, device=device)


@functools.cache
def _typed(lib: ctypes.CDLL) -> ctypes._CFuncPtr:
    return native_prototypes.typed(lib, NATIVE_SOURCE, "ro_apply")


def _native_takes(input: Tensor, r1: Tensor, r2: Tensor) -> bool:
    """Whether the native kernel applies: fp32 or bf16 CPU tensors (all three share input's dtype) and a library."""
    return input.dtype in NATIVE_DTYPES and all(t.is_cpu for t in (input, r1, r2)) and bool(native.load(NATIVE_SOURCE))


def _native_plan(input: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str) -> Callable[..., Tensor] | None:
    """The native kernel for calls of this signature, its sizes and strides as ctypes arrays made once, or None
    where it does not apply."""
    if not _native_takes(input, r1, r2):
        return None
    dims = ctypes.c_int64 * 4
    out_strides = torch.empty_like(input).stride()      # empty_like's layout follows input's strides
    shape_args = (dims(*input.shape), dims(*input.stride()),
                  *(dims(*(0 if n == 1 else st for n, st in zip(t.shape, t.stride()))) for t in (r1, r2)),
                  dims(*out_strides), MODES.index(rotary_mode), native.DTYPE_CODES[input.dtype])
    fn = _typed(native.load(NATIVE_SOURCE).lib)

    def plan(input: Tensor, r1: Tensor, r2: Tensor) -> Tensor:
        out = torch.empty_like(input)
        fn(input.data_ptr(), r1.data_ptr(), r2.data_ptr(), out.data_ptr(), *shape_args)
        return out

    return plan


def _torch_plan(input: Tensor, rotary_mode: str) -> Callable[..., Tensor]:
    """The torch arithmetic for calls of this signature: a few rows, one gather of the swapped pairs (order and
    sign made once); more rows, `_rotary_mul_halves`."""
    if input.numel() > FEW_ELEMS:
        return functools.partial(_rotary_mul_halves, rotary_mode=rotary_mode)
    order, sign = _swap(input.shape[-1], rotary_mode, input.dtype, input.device)

    def plan(input: Tensor, r1: Tensor, r2: Tensor) -> Tensor:
        return torch.mul(input, r1, out=torch.empty_like(input)).add_(input.index_select(-1, order).mul_(r2 * sign))

    return plan


def _rotary_mul_halves(input: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str) -> Tensor:
    """Many rows: each half of every pair computed straight into the output (o1 = x1·c1 − x2·s1,
    o2 = x2·c2 + x1·s2, the members being halves or adjacent values), no gather."""
    d = input.shape[-1]
    shape, pair_dim = ((2, d // 2), -2) if rotary_mode == "half" else ((d // 2, 2), -1)
    out = torch.empty_like(input)
    x, c, s, o = (t.unflatten(-1, shape) for t in (input, r1, r2, out))
    x1, x2, o1, o2 = x.select(pair_dim, 0), x.select(pair_dim, 1), o.select(pair_dim, 0), o.select(pair_dim, 1)
    torch.mul(x1, c.select(pair_dim, 0), out=o1).sub_(x2 * s.select(pair_dim, 0))
    torch.mul(x2, c.select(pair_dim, 1), out=o2).add_(x1 * s.select(pair_dim, 1))
    return out


_PLANS = call_plans.Plans(OP)


@torch.library.custom_op("ascend_dsa::rotary_mul", mutates_args=())
@tensors_given
def rotary_mul(input: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half") -> Tensor:
    """RoPE: r1 · input + r2 · rotate(input); see the module docstring."""
    if static_checks_needed():
        _check(input, r1, r2, rotary_mode)
    signature = (input.shape, input.stride(), input.dtype, input.is_cpu, r1.shape, r1.stride(), r1.dtype, r1.is_cpu,
                 r2.shape, r2.stride(), r2.dtype, r2.is_cpu, rotary_mode)
    plan = _PLANS.get(signature)
    return plan(input, r1, r2) if plan is not None else _first_call(input, r1, r2, rotary_mode, signature)


def _first_call(input: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str, signature: tuple) -> Tensor:
    """The native kernel or the torch path, measured (kernels/native/dispatch.py) where the kernel takes the call;
    stores the plan of the choice for `signature` (kernels/native/call_plans)."""
    def run() -> Tensor:
        return _rotary_mul_cpu(input, r1, r2, rotary_mode)

    cls = native_class(input, r1, r2, rotary_mode)
    if cls is None:
        _PLANS.put(signature, _torch_plan(input, rotary_mode))
        return run()
    result = dispatch.run(OP, NATIVE_SOURCE, cls, run, dispatch.torch_path(run))
    impl = dispatch.known(OP, cls)
    if impl is not None:
        native_plan = _native_plan(input, r1, r2, rotary_mode) if impl == "native" else None
        _PLANS.put(signature, native_plan or _torch_plan(input, rotary_mode))
    return result


def native_class(input: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half") -> tuple | None:
    """The shape class kernels/native/dispatch.py measures for a call the native kernel takes (fp32 or bf16 on the
    CPU), else None."""
    if not _native_takes(input, r1, r2):
        return None
    return dispatch.shape_class(input.dtype, *input.shape, *(n == 1 for n in r1.shape), input.stride(-1) == 1,
                                rotary_mode)


def _rotary_mul_cpu(input: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str) -> Tensor:
    return (_native_plan(input, r1, r2, rotary_mode) or _torch_plan(input, rotary_mode))(input, r1, r2)


@rotary_mul.register_fake
def _(input: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half") -> Tensor:
    _check(input, r1, r2, rotary_mode)
    return torch.empty_like(input)


def reference_rotary_mul(input: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half") -> Tensor:
    """The definition in fp32, as torch_npu documents it, rounded once to input's dtype."""
    _check(input, r1, r2, rotary_mode)
    x = input.float()
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return (r1.float() * x + r2.float() * rotated).to(input.dtype)

"""MX quantization (OCP Microscaling v1.0): `ascend_dsa::dynamic_mx_quant` and `ascend_dsa::dequant_mx`.

Mirrors `torch_npu.npu_dynamic_mx_quant` with `scale_alg=0` (the OCP algorithm) and `round_mode="rint"`.
Along `axis`, every `block_size` consecutive elements share one E8M0 scale (a bare power of two):

    shared_exp = floor(log2(max_i |V_i|)) - emax      emax = 8 (float8_e4m3fn) or 15 (float8_e5m2)
    scale      = 2^clamp(shared_exp, -127, 127)
    P_i        = round_to_nearest_even(clamp(V_i / scale, -max, max))     max = 448 or 57344

`floor(log2 amax)` is read off the fp32 exponent bits of amax, never taken from a float -> e8m0 cast
(that cast rounds to the nearest power of two). A block of zeros, or one whose shared_exp falls below
-127, gets the smallest scale 2^-127 (byte 0x00).

Non-finite values. A block holding NaN or ±inf gets the NaN scale (byte 0xFF) and all of its `y` set to 0:
OCP decodes every element of a NaN-scaled block as NaN whatever its bits are, so `y` stays finite and the NaN
travels in the scale alone; finite values up to the fp32 maximum quantize as any others. `dequant_mx` decodes
every value of a block whose scale is 0xFF as NaN, an fp8 NaN code as NaN and an e5m2 infinity as ±inf.

The scale has the shape of `x` with the `axis` dimension divided by `block_size` (dtype
`torch.float8_e8m0fnu`). The NPU op stores the same bytes with pairs of neighbouring scales interleaved in
an extra trailing dimension of 2; the NPU target reshapes, the values are the same.

This module also holds the fp8 decoding shared with `block` (kernels/quant/block.py): an exact fp8 -> fp32 conversion by
bit operations, several times faster on CPU than `Tensor.float()` on an fp8 tensor.
"""
import math

import torch
from torch import Tensor

from npu_graph.kernels.checks import (
    require,
    require_choice,
    require_divisible,
    require_dtype,
    require_positive,
    tensors_given,
)

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPE = torch.float8_e8m0fnu
CHUNK_ELEMS = 1 << 20
_E4M3_TO_F16_MASK = -16512  # int16 0xBF80: sign bit and the 7 magnitude bits of an e4m3 byte shifted left by 7
_E4M3_NAN_AS_F16 = 1.875    # what the e4m3 NaN codes 0x7F/0xFF read as after that shift; finite codes stay <= 1.75


def chunk_bounds(blocks: int, block_elems: int) -> list[tuple[int, int]]:
    """Split `blocks` blocks of `block_elems` elements into runs of about CHUNK_ELEMS elements, so that
    the temporaries of one run stay in cache."""
    step = max(1, CHUNK_ELEMS // max(1, block_elems))
    return [(start, min(start + step, blocks)) for start in range(0, blocks, step)]


def normalize_axis(op: str, axis: int, ndim: int) -> int:
    require(-ndim <= axis < ndim, f"{op}: `axis`={axis} is out of range for a tensor of rank {ndim}")
    return axis % ndim


def mx_scale_shape(shape: torch.Size, axis: int, block_size: int) -> list[int]:
    """Shape of the scale of an MX-quantized tensor of `shape`: the `axis` dimension divided by block_size."""
    out = list(shape)
    out[axis] = out[axis] // block_size
    return out


def _check_quant(op: str, x: Tensor, axis: int, block_size: int, dst_type: torch.dtype) -> int:
    require(x.dim() >= 1, f"{op}: `x` must have at least one dimension, got a scalar")
    require_dtype(op, "x", x, FLOAT_DTYPES)
    require_choice(op, "dst_type", dst_type, tuple(FP8_MAX))
    require_positive(op, "block_size", block_size)
    axis = normalize_axis(op, axis, x.dim())
    require_divisible(op, f"x.shape[{axis}] (`axis`={axis})", x.shape[axis], block_size)
    return axis


def _blocks(t: Tensor, axis: int, block_size: int) -> Tensor:
    """View a contiguous tensor as [blocks, block_size, trailing]: the blocks run along `axis`."""
    return t.view(-1, block_size, math.prod(t.shape[axis + 1:]))


def _quant_run(xb: Tensor, y: Tensor, scale_bits: Tensor, dst_type: torch.dtype) -> None:
    """Quantize one run of blocks xb [b, block, trailing] into y (fp8) and scale_bits (uint8, biased).

    The biased exponent field of amax is floor(log2 amax) + 127 (0 for zero and subnormal amax, 0xFF for
    inf and NaN). 1 / scale = 2^(127 - shared) is a normal fp32 for every shared in [0, 247], so x times
    it rounds exactly like x / scale.
    """
    xf = xb.float()
    biased = (xf.abs().amax(1).view(torch.int32) >> 23) & 0xFF
    nonfinite = biased == 0xFF
    shared = (biased - FP8_EMAX[dst_type]).clamp_(min=0)
    reciprocal = ((254 - shared) << 23).view(torch.float32)
    limit = FP8_MAX[dst_type]
    y.copy_((xf * reciprocal.unsqueeze(1)).clamp_(-limit, limit))
    if nonfinite.any():
        y.view(torch.uint8).masked_fill_(nonfinite.unsqueeze(1), 0)
        shared.masked_fill_(nonfinite, 0xFF)
    scale_bits.copy_(shared)


@torch.library.custom_op("ascend_dsa::dynamic_mx_quant", mutates_args=())
@tensors_given
def dynamic_mx_quant(x: Tensor, *, axis: int = -1, block_size: int = 32,
                     dst_type: torch.dtype = torch.float8_e4m3fn) -> tuple[Tensor, Tensor]:
    """MX-quantize `x` along `axis`: returns (y in dst_type, scale float8_e8m0fnu)."""
    axis = _check_quant("dynamic_mx_quant", x, axis, block_size, dst_type)
    xb = _blocks(x.contiguous(), axis, block_size)
    y = torch.empty(xb.shape, dtype=dst_type)
    scale_bits = torch.empty(xb.shape[0], xb.shape[2], dtype=torch.uint8)
    for start, stop in chunk_bounds(xb.shape[0], block_size * xb.shape[2]):
        _quant_run(xb[start:stop], y[start:stop], scale_bits[start:stop], dst_type)
    scale = scale_bits.view(SCALE_DTYPE).view(mx_scale_shape(x.shape, axis, block_size))
    return y.view(x.shape), scale


@dynamic_mx_quant.register_fake
def _(x: Tensor, *, axis: int = -1, block_size: int = 32,
      dst_type: torch.dtype = torch.float8_e4m3fn) -> tuple[Tensor, Tensor]:
    axis = _check_quant("dynamic_mx_quant", x, axis, block_size, dst_type)
    return (x.new_empty(x.shape, dtype=dst_type),
            x.new_empty(mx_scale_shape(x.shape, axis, block_size), dtype=SCALE_DTYPE))


def reference_dynamic_mx_quant(x: Tensor, *, axis: int = -1, block_size: int = 32,
                               dst_type: torch.dtype = torch.float8_e4m3fn) -> tuple[Tensor, Tensor]:
    """The OCP formula in plain fp32 math, one block per row of a [..., blocks, block_size] view."""
    blocks = x.float().movedim(axis, -1).unflatten(-1, (-1, block_size))
    amax = blocks.abs().amax(-1, keepdim=True)
    _, exponent = torch.frexp(amax)                      # amax = m * 2^exponent with m in [0.5, 1)
    shared_exp = (exponent - 1 - FP8_EMAX[dst_type]).clamp(-127, 127)   # floor(log2 amax) - emax
    shared_exp = torch.where(amax == 0, -127, shared_exp)
    bad = ~torch.isfinite(amax)
    limit = FP8_MAX[dst_type]
    y = (blocks / torch.exp2(shared_exp.float())).clamp(-limit, limit)
    y = torch.where(bad, 0.0, y).flatten(-2).movedim(-1, axis).to(dst_type)
    scale_byte = torch.where(bad, 255, shared_exp + 127).squeeze(-1).movedim(-1, axis)
    return y, scale_byte.to(torch.uint8).view(SCALE_DTYPE)


def fp8_as_float16(codes: Tensor) -> tuple[Tensor, int]:
    """Reinterpret fp8 codes as float16 values equal to the fp8 values times 2^-shift; returns (f16, shift).

    e5m2 is the top byte of a float16. An e4m3 byte moved 7 bits up lands its exponent and mantissa in
    float16's fields, which re-biases it by 2^-8 (subnormals included); the NaN codes 0x7F/0xFF come out
    as ±1.875 and are patched by the caller. The float16 -> float32 conversion that follows is exact.
    """
    wide = codes.view(torch.int8).to(torch.int16)
    if codes.dtype == torch.float8_e5m2:
        return wide.bitwise_left_shift_(8).view(torch.float16), 0
    return wide.bitwise_left_shift_(7).bitwise_and_(_E4M3_TO_F16_MASK).view(torch.float16), 8


def decode_fp8_scaled(codes: Tensor, factor: Tensor, out: Tensor) -> None:
    """out[...] = codes (fp8) * factor (fp32, broadcast), rounded as `(codes.float() * factor).to(out.dtype)`."""
    half, shift = fp8_as_float16(codes)
    value = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32)
    value.copy_(half)
    if shift:
        low, high = torch.aminmax(value)
        if high.item() >= _E4M3_NAN_AS_F16 or low.item() <= -_E4M3_NAN_AS_F16:
            value.masked_fill_(value.abs() == _E4M3_NAN_AS_F16, float("nan"))
        value.mul_(2.0 ** shift)
    value.mul_(factor)
    if value is not out:
        out.copy_(value)


def e8m0_to_float32(scale: Tensor) -> Tensor:
    """Exact fp32 value of E8M0 scales: 2^(byte - 127); byte 0 is 2^-127 (fp32 subnormal), 0xFF is NaN."""
    byte = scale.view(torch.uint8).to(torch.int32)
    value = (byte << 23).view(torch.float32)
    value = torch.where(byte == 0, 2.0 ** -127, value)
    return torch.where(byte == 0xFF, float("nan"), value)


def _check_dequant(y: Tensor, scale: Tensor, axis: int, block_size: int, dst_type: torch.dtype) -> int:
    op = "dequant_mx"
    require(y.dim() >= 1, f"{op}: `y` must have at least one dimension, got a scalar")
    require_dtype(op, "y", y, tuple(FP8_MAX))
    require_dtype(op, "scale", scale, (SCALE_DTYPE,))
    require_choice(op, "dst_type", dst_type, FLOAT_DTYPES)
    require_positive(op, "block_size", block_size)
    axis = normalize_axis(op, axis, y.dim())
    require_divisible(op, f"y.shape[{axis}] (`axis`={axis})", y.shape[axis], block_size)
    expected = mx_scale_shape(y.shape, axis, block_size)
    require(list(scale.shape) == expected,
            f"{op}: `scale` has shape {tuple(scale.shape)}; expected {tuple(expected)} for `y` of shape "
            f"{tuple(y.shape)} with axis={axis}, block_size={block_size}")
    return axis


@torch.library.custom_op("ascend_dsa::dequant_mx", mutates_args=())
@tensors_given
def dequant_mx(y: Tensor, scale: Tensor, *, axis: int = -1, block_size: int = 32,
               dst_type: torch.dtype = torch.float32) -> Tensor:
    """Inverse of dynamic_mx_quant: y * 2^(scale - 127), computed in fp32, returned in dst_type."""
    axis = _check_dequant(y, scale, axis, block_size, dst_type)
    yb = _blocks(y.contiguous(), axis, block_size)
    factor = e8m0_to_float32(scale.contiguous()).view(yb.shape[0], 1, yb.shape[2])
    out = torch.empty(yb.shape, dtype=dst_type)
    for start, stop in chunk_bounds(yb.shape[0], block_size * yb.shape[2]):
        decode_fp8_scaled(yb[start:stop], factor[start:stop], out[start:stop])
    return out.view(y.shape)


@dequant_mx.register_fake
def _(y: Tensor, scale: Tensor, *, axis: int = -1, block_size: int = 32,
      dst_type: torch.dtype = torch.float32) -> Tensor:
    _check_dequant(y, scale, axis, block_size, dst_type)
    return y.new_empty(y.shape, dtype=dst_type)


def reference_dequant_mx(y: Tensor, scale: Tensor, *, axis: int = -1, block_size: int = 32,
                         dst_type: torch.dtype = torch.float32) -> Tensor:
    """y * 2^(scale_byte - 127) in fp32, each scale repeated over its block along `axis`."""
    byte = scale.view(torch.uint8).float()
    factor = torch.where(byte == 255, float("nan"), torch.exp2(byte - 127))
    return (y.float() * factor.repeat_interleave(block_size, dim=axis)).to(dst_type)

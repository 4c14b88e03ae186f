"""Per-tile fp8 / int8 quantization (DeepSeek-V3 `act_quant`, `torch_npu.npu_dynamic_block_quant`):
`ascend_dsa::dynamic_block_quant` and `ascend_dsa::dequant_block`.

Every row of `x` (all leading dimensions: per token, per head) is cut into tiles of `block_size`
consecutive elements of the last dimension; each tile gets one fp32 scale:

    s = max(amax, 1e-4) / M                amax = max |x| over the tile; M = 448 (float8_e4m3fn) or 127 (int8)
    s = 2^ceil(log2 s)                     only with scale_fmt="ue8m0" (rounded up, so |x / s| <= M still)
    y = float8_e4m3fn(clamp(x / s, -448, 448))     dst_type float8_e4m3fn (the default): round to nearest even
    y = int8(clamp(rint(x / s), -127, 127))        dst_type int8: symmetric, round half to even

With block_size equal to the row length, int8 is per-token (per token and head) symmetric quantization, the
format of Ascend's quantized lightning indexer on Atlas A2/A3 (which have int8 cube units and no fp8 ones).

The ue8m0 rounding is done on the fp32 bits (add 0x7FFFFF, keep the exponent), never through log2. `scale`
has shape [..., D / block_size] and dtype float32 in both formats: with "ue8m0" its values are exact powers
of two, ready to be stored as E8M0.

Non-finite values. A tile holding NaN or ±inf gets a NaN scale and all of its `y` set to 0, so `y` is always
finite (the rule of `dynamic_mx_quant`); finite values up to the fp32 maximum quantize as any others.
`dequant_block` decodes every value of a tile whose scale is NaN as NaN, an fp8 NaN code as NaN, and with an
infinite scale gives ±inf (NaN where y is 0), as the product y · scale does.
"""
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
from npu_graph.kernels.quant.mx import FLOAT_DTYPES, chunk_bounds, decode_fp8_scaled

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
AMAX_FLOOR = 1e-4
SCALE_FORMATS = ("fp32", "ue8m0")
CODE_MAX = {FP8: FP8_MAX, torch.int8: INT8_MAX}     # the largest code of each dst_type


def _scale_shape(shape: torch.Size, block_size: int) -> list[int]:
    return [*shape[:-1], shape[-1] // block_size]


def _check_quant(x: Tensor, block_size: int, scale_fmt: str, dst_type: torch.dtype) -> None:
    op = "dynamic_block_quant"
    require(x.dim() >= 1, f"{op}: `x` must have at least one dimension, got a scalar")
    require_dtype(op, "x", x, FLOAT_DTYPES)
    require_positive(op, "block_size", block_size)
    require_choice(op, "scale_fmt", scale_fmt, SCALE_FORMATS)
    require_choice(op, "dst_type", dst_type, tuple(CODE_MAX))
    require_divisible(op, "x.shape[-1]", x.shape[-1], block_size)


def round_up_pow2(s: Tensor) -> Tensor:
    """2^ceil(log2 s) for positive normal fp32 `s`, by bit operations: any mantissa bit carries into the
    exponent, then the mantissa is cleared."""
    bits = (s.view(torch.int32) + 0x7FFFFF).bitwise_and_(0x7F800000)
    return bits.view(torch.float32)


def _quant_run(xb: Tensor, y: Tensor, scale: Tensor, ue8m0: bool) -> None:
    """Quantize one run of tiles xb [b, block] into y [b, block] (fp8 or int8) and scale [b, 1] (fp32)."""
    top = CODE_MAX[y.dtype]
    xf = xb.float()
    amax = xf.abs().amax(1, keepdim=True)
    s = amax.clamp(min=AMAX_FLOOR).div_(top)
    if ue8m0:
        s = round_up_pow2(s)
    nonfinite = ~torch.isfinite(amax)
    bad = bool(nonfinite.any())
    if bad:
        s.masked_fill_(nonfinite, float("nan"))
    codes = (xf / s).clamp_(-top, top)
    y.copy_(codes if y.dtype == FP8 else codes.round_())
    if bad:
        y.view(torch.uint8).masked_fill_(nonfinite, 0)
    scale.copy_(s)


@torch.library.custom_op("ascend_dsa::dynamic_block_quant", mutates_args=())
@tensors_given
def dynamic_block_quant(x: Tensor, *, block_size: int = 128, scale_fmt: str = "fp32",
                        dst_type: torch.dtype = FP8) -> tuple[Tensor, Tensor]:
    """Quantize `x` per `block_size` tile of its last dimension: returns (y of dst_type, scale fp32)."""
    _check_quant(x, block_size, scale_fmt, dst_type)
    xb = x.contiguous().view(-1, block_size)
    y = torch.empty(xb.shape, dtype=dst_type)
    scale = torch.empty(xb.shape[0], 1, dtype=torch.float32)
    for start, stop in chunk_bounds(xb.shape[0], block_size):
        _quant_run(xb[start:stop], y[start:stop], scale[start:stop], scale_fmt == "ue8m0")
    return y.view(x.shape), scale.view(_scale_shape(x.shape, block_size))


@dynamic_block_quant.register_fake
def _(x: Tensor, *, block_size: int = 128, scale_fmt: str = "fp32",
      dst_type: torch.dtype = FP8) -> tuple[Tensor, Tensor]:
    _check_quant(x, block_size, scale_fmt, dst_type)
    return x.new_empty(x.shape, dtype=dst_type), x.new_empty(_scale_shape(x.shape, block_size), dtype=torch.float32)


def reference_dynamic_block_quant(x: Tensor, *, block_size: int = 128, scale_fmt: str = "fp32",
                                  dst_type: torch.dtype = FP8) -> tuple[Tensor, Tensor]:
    """DeepSeek act_quant in plain fp32 math on a [..., tiles, block_size] view (int8: rounded half to even)."""
    top = CODE_MAX[dst_type]
    tiles = x.float().unflatten(-1, (-1, block_size))
    amax = tiles.abs().amax(-1, keepdim=True)
    scale = amax.clamp(min=AMAX_FLOOR) / top
    if scale_fmt == "ue8m0":
        mantissa, exponent = torch.frexp(scale)        # scale = mantissa * 2^exponent, mantissa in [0.5, 1)
        scale = torch.where(mantissa == 0.5, scale, torch.ldexp(torch.ones_like(scale), exponent))
    bad = ~torch.isfinite(amax)
    scale = torch.where(bad, float("nan"), scale)
    y = torch.where(bad, 0.0, (tiles / scale).clamp(-top, top))
    if dst_type == torch.int8:
        y = torch.round(y)
    return y.flatten(-2).to(dst_type), scale.squeeze(-1)


def _check_dequant(y: Tensor, scale: Tensor, block_size: int, dst_type: torch.dtype) -> None:
    op = "dequant_block"
    require(y.dim() >= 1, f"{op}: `y` must have at least one dimension, got a scalar")
    require_dtype(op, "y", y, tuple(CODE_MAX))
    require_dtype(op, "scale", scale, (torch.float32,))
    require_choice(op, "dst_type", dst_type, FLOAT_DTYPES)
    require_positive(op, "block_size", block_size)
    require_divisible(op, "y.shape[-1]", y.shape[-1], block_size)
    expected = _scale_shape(y.shape, block_size)
    require(list(scale.shape) == expected,
            f"{op}: `scale` has shape {tuple(scale.shape)}; expected {tuple(expected)} for `y` of shape "
            f"{tuple(y.shape)} with block_size={block_size}")


@torch.library.custom_op("ascend_dsa::dequant_block", mutates_args=())
@tensors_given
def dequant_block(y: Tensor, scale: Tensor, *, block_size: int = 128,
                  dst_type: torch.dtype = torch.float32) -> Tensor:
    """Inverse of dynamic_block_quant: y * scale per tile, computed in fp32, returned in dst_type."""
    _check_dequant(y, scale, block_size, dst_type)
    yb = y.contiguous().view(-1, block_size)
    factor = scale.contiguous().view(-1, 1)
    out = torch.empty(yb.shape, dtype=dst_type)
    for start, stop in chunk_bounds(yb.shape[0], block_size):
        if y.dtype == FP8:
            decode_fp8_scaled(yb[start:stop], factor[start:stop], out[start:stop])
        else:
            torch.mul(yb[start:stop], factor[start:stop], out=out[start:stop])
    return out.view(y.shape)


@dequant_block.register_fake
def _(y: Tensor, scale: Tensor, *, block_size: int = 128, dst_type: torch.dtype = torch.float32) -> Tensor:
    _check_dequant(y, scale, block_size, dst_type)
    return y.new_empty(y.shape, dtype=dst_type)


def reference_dequant_block(y: Tensor, scale: Tensor, *, block_size: int = 128,
                            dst_type: torch.dtype = torch.float32) -> Tensor:
    """y * scale in fp32, each scale repeated over its tile of the last dimension."""
    return (y.float() * scale.repeat_interleave(block_size, dim=-1)).to(dst_type)

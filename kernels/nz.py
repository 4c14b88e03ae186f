"""FRACTAL_NZ layout: pack the last two dimensions [..., M, N] of a tensor into Ascend's NZ tiling and back.

NZ (ACL format 29, what `torch_npu.npu_format_cast(w, 29)` produces) cuts the matrix into fractals of
16 rows x C0 columns, C0 being 32 bytes of elements, and stores them column-block major:

    packed[..., n1, m1, m0, n0] = x[..., m1 * 16 + m0, n1 * C0 + n0]      packed: [..., N1, M1, 16, C0]

with M1 = ceil(M / 16), N1 = ceil(N / C0); M and N are padded with zeros up to whole fractals. Ascend's
own documentation writes the same bytes as [..., N1, M1*16, C0] (ND (8, 100, 30) fp16 -> NZ (8, 2, 112,
16)); here the 16-row fractal keeps its own dimension. C0 is 32 for 1-byte dtypes (fp8, int8: fractal
16 x 32) and 16 for 2-byte dtypes (bf16, fp16: 16 x 16). 4-byte dtypes also use 16 x 16 fractals, the
classic torch_npu layout for fp32 (the newer aclnn path can pick C0 = 32 bytes / 4 = 8 instead).

Plain functions, not ops: packing is done once at load time, on weights. Both directions move raw bits
through an integer view, so the round trip is bit exact for every dtype, fp8 and NaN payloads included,
and each is a single strided copy (plus zeroing the padding), no padded intermediate.
"""
import torch
from torch import Tensor

from npu_graph.kernels.checks import require

FRACTAL_ROWS = 16
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def nz_fractal(dtype: torch.dtype) -> tuple[int, int]:
    """(rows, columns) of one NZ fractal for `dtype`: (16, 32) for 1-byte, (16, 16) for 2- and 4-byte."""
    size = dtype.itemsize
    require(size in _BITS_DTYPE, f"nz: dtype {dtype} ({size} bytes per element) has no NZ layout; "
                                 f"use a 1-, 2- or 4-byte dtype")
    return FRACTAL_ROWS, 32 if size == 1 else 16


def nz_shape(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Size:
    """Shape [..., N1, M1, 16, C0] of the NZ packing of a tensor of `shape` [..., M, N] and `dtype`."""
    require(len(shape) >= 2, f"nz: NZ tiles the last two dimensions; shape {tuple(shape)} has rank {len(shape)}")
    rows, cols = nz_fractal(dtype)
    *batch, m, n = shape
    return torch.Size([*batch, -(-n // cols), -(-m // rows), rows, cols])


def _grid(packed_bits: Tensor) -> Tensor:
    """View packed [..., N1, M1, 16, C0] as the padded matrix cut into column blocks: [..., M1*16, N1, C0]."""
    *batch, n1, m1, rows, cols = packed_bits.shape
    return packed_bits.movedim(-4, -2).view(*batch, m1 * rows, n1, cols)


def pack_nz(x: Tensor) -> Tensor:
    """Pack `x` [..., M, N] into FRACTAL_NZ [..., N1, M1, 16, C0], zero padded; same dtype as `x`."""
    target = nz_shape(x.shape, x.dtype)
    bits = x.view(_BITS_DTYPE[x.dtype.itemsize])
    out = torch.empty(target, dtype=bits.dtype)
    grid = _grid(out)
    *batch, m, n = x.shape
    cols = grid.shape[-1]
    full, tail = divmod(n, cols)
    grid[..., :m, :full, :].copy_(bits[..., :full * cols].view(*batch, m, full, cols))
    if tail:
        grid[..., :m, full, :tail].copy_(bits[..., full * cols:])
        grid[..., :m, full, tail:].zero_()
    grid[..., m:, :, :].zero_()
    return out.view(x.dtype)


def unpack_nz(packed: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """Inverse of pack_nz: the [..., M, N] tensor of `shape` whose packing is `packed`."""
    expected = nz_shape(shape, packed.dtype)
    require(packed.shape == expected, f"unpack_nz: `packed` has shape {tuple(packed.shape)}; the NZ packing of "
                                      f"shape {tuple(shape)} in {packed.dtype} is {tuple(expected)}")
    grid = _grid(packed.view(_BITS_DTYPE[packed.dtype.itemsize]))
    *batch, m, n = shape
    cols = grid.shape[-1]
    full, tail = divmod(n, cols)
    out = torch.empty(shape, dtype=grid.dtype)
    out[..., :full * cols].view(*batch, m, full, cols).copy_(grid[..., :m, :full, :])
    if tail:
        out[..., full * cols:].copy_(grid[..., :m, full, :tail])
    return out.view(packed.dtype)

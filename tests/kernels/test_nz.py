"""FRACTAL_NZ packing (npu_graph.kernels.nz): the documented index mapping, zero padding, shapes, bit-exact
round trip for every element size, clear errors."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from npu_graph.kernels import nz

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Every bit pattern is possible, NaN payloads included: the packing must move bits, not values."""
    g = torch.Generator().manual_seed(seed)
    bits = BITS[dtype.itemsize]
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(bits).view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(BITS[a.dtype.itemsize]), b.view(BITS[b.dtype.itemsize]))


def test_fractal_sizes_follow_32_byte_rows():
    assert nz.nz_fractal(torch.float8_e4m3fn) == (16, 32)
    assert nz.nz_fractal(torch.int8) == (16, 32)
    assert nz.nz_fractal(torch.bfloat16) == (16, 16)
    assert nz.nz_fractal(torch.float16) == (16, 16)
    assert nz.nz_fractal(torch.float32) == (16, 16)


def test_shape_matches_the_ascend_documentation_example():
    # Ascend TransdataOperation: ND (8, 100, 30) fp16 -> NZ (8, 2, 112, 16), i.e. [b, N1, M1*16, C0].
    shape = nz.nz_shape((8, 100, 30), torch.float16)
    assert shape == (8, 2, 7, 16, 16)
    assert (shape[0], shape[1], shape[2] * shape[3], shape[4]) == (8, 2, 112, 16)
    assert nz.nz_shape((64, 96), torch.float8_e4m3fn) == (3, 4, 16, 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_every_element_lands_where_the_nz_formula_says(dtype):
    m, n = 37, 70
    x = random_bits((2, m, n), dtype, seed=1)
    packed = nz.pack_nz(x)
    rows, cols = nz.nz_fractal(dtype)
    pb, xb = packed.view(BITS[dtype.itemsize]), x.view(BITS[dtype.itemsize])
    for b in range(2):
        for i in range(m):
            for j in range(n):
                assert pb[b, j // cols, i // rows, i % rows, j % cols] == xb[b, i, j]


def test_padding_is_zero():
    x = torch.full((17, 20), -1.5, dtype=torch.bfloat16)
    packed = nz.pack_nz(x)
    assert packed.shape == (2, 2, 16, 16)
    plain = packed.movedim(-4, -2).reshape(32, 32)
    assert (plain[:17, :20] == -1.5).all()
    assert not plain[17:].any() and not plain[:, 20:].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 128), (100, 50), (33, 70), (1, 1), (16, 32), (3, 17, 40), (2, 2, 5, 9),
                                   (0, 20), (4, 0)])
def test_round_trip_is_bit_exact(dtype, shape):
    x = random_bits(shape, dtype)
    packed = nz.pack_nz(x)
    assert packed.shape == nz.nz_shape(shape, dtype) and packed.dtype == dtype and packed.is_contiguous()
    back = nz.unpack_nz(packed, x.shape)
    assert back.shape == x.shape and back.is_contiguous() and same_bits(back, x)


def test_non_contiguous_input_packs_like_its_contiguous_copy():
    x = random_bits((48, 40), torch.float16).t()
    assert same_bits(nz.pack_nz(x), nz.pack_nz(x.contiguous()))


@settings(max_examples=40, deadline=None)
@given(batch=st.lists(st.integers(1, 3), max_size=2), m=st.integers(1, 70), n=st.integers(1, 90),
       dtype=st.sampled_from(DTYPES))
def test_round_trip_law(batch, m, n, dtype):
    x = random_bits((*batch, m, n), dtype, seed=m * 131 + n)
    packed = nz.pack_nz(x)
    rows, cols = nz.nz_fractal(dtype)
    padded_m, padded_n = -(-m // rows) * rows, -(-n // cols) * cols
    assert packed.numel() == x.numel() // (m * n) * padded_m * padded_n
    plain = packed.view(BITS[dtype.itemsize]).movedim(-4, -2).reshape(*batch, padded_m, padded_n)
    assert not plain[..., m:, :].any() and not plain[..., :, n:].any()
    assert same_bits(nz.unpack_nz(packed, x.shape), x)


def test_errors_are_clear():
    with pytest.raises(ValueError, match=r"last two dimensions; shape \(8,\) has rank 1"):
        nz.pack_nz(torch.zeros(8))
    with pytest.raises(ValueError, match=r"torch\.float64 \(8 bytes per element\) has no NZ layout"):
        nz.pack_nz(torch.zeros(4, 4, dtype=torch.float64))
    packed = nz.pack_nz(torch.zeros(20, 20, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"the NZ packing of shape \(40, 20\)"):
        nz.unpack_nz(packed, (40, 20))

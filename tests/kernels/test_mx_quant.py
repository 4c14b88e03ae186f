"""ascend_dsa::dynamic_mx_quant and ascend_dsa::dequant_mx: fast path against the reference, the OCP MX laws
(floor-log2 power-of-two scales, half-ulp round trip, saturation, zero and NaN blocks), errors, compile."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from npu_graph.kernels.quant import mx as mx_quant
from npu_graph.kernels.quant.mx import reference_dequant_mx, reference_dynamic_mx_quant

OPS = torch.ops.ascend_dsa
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_FORMATS = {E4M3: (8, 448.0, 3, -6), E5M2: (15, 57344.0, 2, -14)}  # emax, max, mantissa bits, min normal exp


def codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def scale_exponent(scale: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent of each E8M0 scale, read independently of the op's own decoding."""
    return codes(scale).long() - 127


def spread(shape: tuple[int, ...], dtype: torch.dtype, low: int, high: int, seed: int = 0) -> torch.Tensor:
    """Normal values times 2^k with k uniform in [low, high): magnitudes over many binades per tensor."""
    g = torch.Generator().manual_seed(seed)
    exponents = torch.randint(low, high, shape, generator=g).float()
    return (torch.randn(shape, generator=g) * torch.exp2(exponents)).to(dtype)


EXPONENT_RANGE = {torch.float32: (-140, 120), torch.bfloat16: (-130, 120), torch.float16: (-20, 12)}
SHAPES = [((4, 64), -1), ((3, 5, 96), -1), ((64, 3, 2), 0), ((2, 64, 7), 1), ((1, 32), -1), ((0, 64), -1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dst_type", [E4M3, E5M2])
@pytest.mark.parametrize(("shape", "axis"), SHAPES)
def test_fast_matches_reference_bit_for_bit(dtype, dst_type, shape, axis):
    x = spread(shape, dtype, *EXPONENT_RANGE[dtype])
    y, scale = OPS.dynamic_mx_quant(x, axis=axis, block_size=32, dst_type=dst_type)
    y_ref, scale_ref = reference_dynamic_mx_quant(x, axis=axis, block_size=32, dst_type=dst_type)
    assert y.dtype == dst_type and scale.dtype == torch.float8_e8m0fnu
    expected_scale_shape = list(shape)
    expected_scale_shape[axis] //= 32
    assert list(scale.shape) == expected_scale_shape
    assert torch.equal(codes(y), codes(y_ref))
    assert torch.equal(codes(scale), codes(scale_ref))
    for out in (torch.float32, torch.bfloat16):
        back = OPS.dequant_mx(y, scale, axis=axis, block_size=32, dst_type=out)
        assert torch.equal(back, reference_dequant_mx(y, scale, axis=axis, block_size=32, dst_type=out))


def test_block_size_other_than_32_and_non_contiguous_input():
    x = spread((48, 64), torch.float32, -10, 10, seed=1)
    y, scale = OPS.dynamic_mx_quant(x.t(), axis=-1, block_size=16)
    y_ref, scale_ref = reference_dynamic_mx_quant(x.t().contiguous(), axis=-1, block_size=16)
    assert scale.shape == (64, 3)
    assert torch.equal(codes(y), codes(y_ref)) and torch.equal(codes(scale), codes(scale_ref))


def test_results_do_not_depend_on_the_run_size(monkeypatch):
    x = spread((74, 96), torch.bfloat16, -30, 30, seed=2)
    x[20, 50] = float("nan")
    y, scale = OPS.dynamic_mx_quant(x, axis=0, block_size=37)
    back = OPS.dequant_mx(y, scale, axis=0, block_size=37)
    monkeypatch.setattr(mx_quant, "CHUNK_ELEMS", 37 * 96)       # one block row of 37 x 96 per run
    y2, scale2 = OPS.dynamic_mx_quant(x, axis=0, block_size=37)
    assert torch.equal(codes(y2), codes(y)) and torch.equal(codes(scale2), codes(scale))
    torch.testing.assert_close(OPS.dequant_mx(y2, scale2, axis=0, block_size=37), back, rtol=0, atol=0,
                               equal_nan=True)
    monkeypatch.setattr(mx_quant, "CHUNK_ELEMS", 100)
    y3, scale3 = OPS.dynamic_mx_quant(x, block_size=32)
    y4, scale4 = reference_dynamic_mx_quant(x, block_size=32)
    assert torch.equal(codes(y3), codes(y4)) and torch.equal(codes(scale3), codes(scale4))


@pytest.mark.parametrize("dst_type", [E4M3, E5M2])
def test_scale_is_floor_log2_amax_minus_emax_not_rounded(dst_type):
    emax = FP8_FORMATS[dst_type][0]
    amax = torch.tensor([1.0, 1.9, 2.0, 2.0 ** 20 * (1 - 2 ** -24), 2.0 ** 20, 3.0e38, 2.0 ** -100])
    x = torch.zeros(len(amax), 32)
    x[:, 3] = -amax
    _, scale = OPS.dynamic_mx_quant(x, dst_type=dst_type)
    want = torch.tensor([0, 0, 1, 19, 20, 127, -100]) - emax
    assert torch.equal(scale_exponent(scale).flatten(), want)
    assert scale_exponent(scale)[1].item() != round(math.log2(1.9 * 2.0 ** -emax))  # 1.9 does not round up


def test_tiny_amax_clamps_to_smallest_scale_and_still_quantizes():
    x = torch.zeros(3, 32)
    x[0, :4] = torch.tensor([1e-40, -3e-41, 5e-42, 0.0])      # fp32 subnormals
    x[1, :2] = torch.tensor([2.0 ** -120, 2.0 ** -121])        # normal, below 2^(-127 + 8)
    y, scale = OPS.dynamic_mx_quant(x)
    assert codes(scale).tolist() == [[0], [0], [0]]
    assert y[1, 0].float().item() == 128.0 and y[1, 1].float().item() == 64.0
    assert y[0, 0].float().item() == pytest.approx(1e-40 * 2.0 ** 127, rel=2 ** -4)
    assert torch.equal(codes(y[2]), torch.zeros(32, dtype=torch.uint8))


@pytest.mark.parametrize("dst_type", [E4M3, E5M2])
def test_saturation_clamps_to_the_largest_finite_value(dst_type):
    emax, limit, _, _ = FP8_FORMATS[dst_type]
    x = torch.full((1, 32), 1.9 * 2.0 ** emax * 4)        # amax/scale = 1.9 * 2^emax > max
    x[0, 1] = -x[0, 1]
    y, scale = OPS.dynamic_mx_quant(x, dst_type=dst_type)
    assert y.float()[0, 0].item() == limit and y.float()[0, 1].item() == -limit
    assert scale_exponent(scale).item() == 2
    assert torch.isfinite(OPS.dequant_mx(y, scale)).all()


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_block_gets_nan_scale_and_zero_codes(poison):
    x = torch.randn(2, 96)
    x[1, 40] = poison
    y, scale = OPS.dynamic_mx_quant(x)
    assert codes(scale)[1].tolist()[1] == 0xFF
    assert torch.equal(codes(y[1, 32:64]), torch.zeros(32, dtype=torch.uint8))
    assert torch.isfinite(y.float()).all()
    back = OPS.dequant_mx(y, scale)
    assert back[1, 32:64].isnan().all()
    assert torch.isfinite(back[1, :32]).all() and torch.isfinite(back[0]).all()
    y_ok, _ = OPS.dynamic_mx_quant(x[:, :32])
    assert torch.equal(codes(y[:, :32]), codes(y_ok))


def test_zero_block_has_scale_two_to_minus_127_and_zero_codes():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    x[1, 40] = 1.0
    y, scale = OPS.dynamic_mx_quant(x)
    assert codes(scale).tolist() == [[0, 0], [0, 119]]
    assert not y.float()[0].any()
    assert OPS.dequant_mx(y, scale)[1, 40].item() == 1.0


@pytest.mark.parametrize("dst_type", [E4M3, E5M2])
def test_fast_fp8_decoding_equals_the_exact_cast_for_every_code(dst_type):
    every = torch.arange(256, dtype=torch.uint8).view(dst_type)
    exact = every.float()
    for factor in (1.0, 2.0 ** -127, 2.0 ** 127, 3.0, 0.1, 2.0 ** 125):
        out = torch.empty(256)
        mx_quant.decode_fp8_scaled(every, torch.tensor(factor), out)
        torch.testing.assert_close(out, exact * factor, rtol=0, atol=0, equal_nan=True)


def test_e8m0_decoding_equals_the_exact_cast_for_every_code():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    torch.testing.assert_close(mx_quant.e8m0_to_float32(every), every.float(), rtol=0, atol=0, equal_nan=True)


def half_ulp_bound(v: torch.Tensor, dst_type: torch.dtype) -> torch.Tensor:
    """Largest |round(v) - v| for round-to-nearest into dst_type: half a unit in the last place of |v|'s
    binade, or of the smallest normal binade for subnormals."""
    _, _, mantissa_bits, min_exp = FP8_FORMATS[dst_type]
    binade = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** min_exp)))
    return torch.exp2(binade - mantissa_bits - 1)


blocks_strategy = st.lists(st.floats(-(2.0 ** 100), 2.0 ** 100, allow_nan=False, width=32), min_size=64, max_size=64)


@settings(max_examples=60, deadline=None)
@given(values=blocks_strategy, dst_type=st.sampled_from([E4M3, E5M2]))
def test_round_trip_error_is_within_half_ulp_or_saturation(values, dst_type):
    limit = FP8_FORMATS[dst_type][1]
    x = torch.tensor(values).view(2, 32)
    y, scale = OPS.dynamic_mx_quant(x, dst_type=dst_type)
    s = torch.exp2(scale_exponent(scale).double())
    v = x.double() / s
    q = y.double()
    saturated = v.abs() > limit
    assert torch.equal(q[saturated], torch.sign(v[saturated]) * limit)
    assert ((q - v).abs() <= half_ulp_bound(v, dst_type))[~saturated].all()
    back = OPS.dequant_mx(y, scale).double()
    assert torch.equal(back, (q * s).float().double())
    amax = x.abs().amax(-1, keepdim=True).double()
    emax = FP8_FORMATS[dst_type][0]
    assert (amax / s < 2.0 ** (emax + 1)).all()
    assert ((amax == 0) | (amax / s >= 2.0 ** emax) | (scale_exponent(scale) == -127)).all()


@settings(max_examples=40, deadline=None)
@given(values=blocks_strategy, dst_type=st.sampled_from([E4M3, E5M2]))
def test_quantizing_a_dequantized_tensor_changes_nothing(values, dst_type):
    x = torch.tensor(values).view(2, 32)
    y, scale = OPS.dynamic_mx_quant(x, dst_type=dst_type)
    y2, scale2 = OPS.dynamic_mx_quant(OPS.dequant_mx(y, scale), dst_type=dst_type)
    assert torch.equal(codes(y2), codes(y)) and torch.equal(codes(scale2), codes(scale))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"block_size": 32}, "not divisible by `block_size`=32"),
    ({"axis": 2}, "out of range"),
    ({"dst_type": torch.int8}, "dst_type"),
    ({"block_size": 0}, "block_size"),
])
def test_quant_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OPS.dynamic_mx_quant(torch.randn(4, 40), **kwargs)


def test_quant_rejects_integer_input_and_dequant_rejects_mismatched_scale():
    with pytest.raises(ValueError, match=r"dtype torch\.int32"):
        OPS.dynamic_mx_quant(torch.ones(2, 32, dtype=torch.int32))
    y, scale = OPS.dynamic_mx_quant(torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"expected \(4, 2\)"):
        OPS.dequant_mx(y, scale[:, :1])
    with pytest.raises(ValueError, match="`scale` has dtype"):
        OPS.dequant_mx(y, scale.view(torch.uint8))
    with pytest.raises(ValueError, match="`y` has dtype"):
        OPS.dequant_mx(y.float(), scale)


def test_opcheck():
    x = torch.randn(3, 64)
    torch.library.opcheck(OPS.dynamic_mx_quant, (x,), {"axis": -1, "block_size": 32, "dst_type": E5M2})
    y, scale = OPS.dynamic_mx_quant(x)
    # test_schema compares fp8 inputs with arithmetic torch lacks for fp8; check the no-mutation part by hand.
    before = codes(y).clone(), codes(scale).clone()
    torch.library.opcheck(OPS.dequant_mx, (y, scale), {"dst_type": torch.bfloat16},
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    assert torch.equal(codes(y), before[0]) and torch.equal(codes(scale), before[1])


def test_inside_torch_compile_with_dynamic_shapes():
    def round_trip(x):
        y, scale = OPS.dynamic_mx_quant(x, axis=-1, block_size=32, dst_type=E4M3)
        return OPS.dequant_mx(y, scale, axis=-1, block_size=32, dst_type=torch.float32) * 2

    compiled = torch.compile(round_trip, fullgraph=True, dynamic=True, backend="eager")
    for rows in (3, 5):
        x = torch.randn(rows, 64)
        assert torch.equal(compiled(x), round_trip(x))

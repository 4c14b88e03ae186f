"""ascend_dsa::dynamic_block_quant and ascend_dsa::dequant_block (DeepSeek act_quant): fast path against the
reference, scale laws for both scale formats, half-ulp round trip, saturation, zero and NaN tiles, errors, compile;
the int8 codes (dst_type=torch.int8) likewise."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from npu_graph.kernels.quant import mx as mx_quant
from npu_graph.kernels.quant.block import reference_dequant_block, reference_dynamic_block_quant

OPS = torch.ops.ascend_dsa
FP8 = torch.float8_e4m3fn


def codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def spread(shape: tuple[int, ...], dtype: torch.dtype, low: int, high: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    exponents = torch.randint(low, high, shape, generator=g).float()
    return (torch.randn(shape, generator=g) * torch.exp2(exponents)).to(dtype)


EXPONENT_RANGE = {torch.float32: (-40, 100), torch.bfloat16: (-40, 100), torch.float16: (-20, 12)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize(("shape", "block_size"), [((2, 256), 128), ((3, 4, 384), 128), ((1, 128), 128),
                                                   ((5, 64), 64), ((0, 128), 128)])
def test_fast_matches_reference_bit_for_bit(dtype, scale_fmt, shape, block_size):
    x = spread(shape, dtype, *EXPONENT_RANGE[dtype])
    y, scale = OPS.dynamic_block_quant(x, block_size=block_size, scale_fmt=scale_fmt)
    y_ref, scale_ref = reference_dynamic_block_quant(x, block_size=block_size, scale_fmt=scale_fmt)
    assert y.dtype == FP8 and scale.dtype == torch.float32
    assert scale.shape == (*shape[:-1], shape[-1] // block_size)
    assert torch.equal(codes(y), codes(y_ref)) and torch.equal(scale, scale_ref)
    for out in (torch.float32, torch.float16):
        back = OPS.dequant_block(y, scale, block_size=block_size, dst_type=out)
        assert torch.equal(back, reference_dequant_block(y, scale, block_size=block_size, dst_type=out))


def test_results_do_not_depend_on_the_run_size(monkeypatch):
    x = spread((37, 256), torch.float16, -10, 10, seed=2)
    x[20, 50] = float("nan")
    y, scale = OPS.dynamic_block_quant(x, scale_fmt="ue8m0")
    back = OPS.dequant_block(y, scale)
    monkeypatch.setattr(mx_quant, "CHUNK_ELEMS", 128 * 5)       # runs of 5 tiles, the last one short
    y2, scale2 = OPS.dynamic_block_quant(x, scale_fmt="ue8m0")
    assert torch.equal(codes(y2), codes(y))
    torch.testing.assert_close(scale2, scale, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(OPS.dequant_block(y2, scale2), back, rtol=0, atol=0, equal_nan=True)


def test_fp32_scale_is_amax_over_448_and_the_tile_max_maps_to_448():
    x = spread((6, 512), torch.float32, -10, 10, seed=3)
    y, scale = OPS.dynamic_block_quant(x)
    amax = x.abs().unflatten(-1, (4, 128)).amax(-1)
    assert torch.equal(scale, amax / 448)
    peak = y.float().abs().unflatten(-1, (4, 128)).amax(-1)
    assert torch.equal(peak, torch.full_like(peak, 448.0))


def test_ue8m0_scale_is_the_smallest_power_of_two_not_below_the_fp32_scale():
    x = spread((6, 512), torch.bfloat16, -30, 30, seed=4)
    x[0, :128] = 448 * 2.0 ** -3                            # amax / 448 is already a power of two
    _, s32 = OPS.dynamic_block_quant(x, scale_fmt="fp32")
    _, s8 = OPS.dynamic_block_quant(x, scale_fmt="ue8m0")
    mantissa, _ = torch.frexp(s8)
    assert (mantissa == 0.5).all()
    assert (s8 >= s32).all() and (s8 < 2 * s32).all()
    assert s8[0, 0].item() == 2.0 ** -3


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_small_tiles_use_the_amax_floor_and_zero_tiles_stay_zero(scale_fmt):
    x = torch.zeros(2, 256)
    x[1, 5] = 1e-6
    x[1, 200] = -3.0
    y, scale = OPS.dynamic_block_quant(x, scale_fmt=scale_fmt)
    floor = torch.tensor(1e-4) / 448
    if scale_fmt == "ue8m0":
        floor = torch.exp2(torch.ceil(torch.log2(floor)))
    assert scale[0, 0].item() == scale[0, 1].item() == scale[1, 0].item() == floor.item()
    assert not y.float()[0].any()
    assert y.float()[1, 5].item() == pytest.approx(1e-6 / floor.item(), rel=2 ** -4)


def test_values_are_clamped_to_448():
    x = torch.randn(4, 128) * 1e30
    y, _ = OPS.dynamic_block_quant(x, scale_fmt="ue8m0")
    assert y.float().abs().max().item() <= 448 and torch.isfinite(y.float()).all()


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nonfinite_tile_gets_nan_scale_and_zero_codes(poison):
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    x[2, 130] = poison
    y, scale = OPS.dynamic_block_quant(x)
    assert scale[2, 1].isnan() and torch.isfinite(scale).sum() == 5
    assert torch.equal(codes(y[2, 128:]), torch.zeros(128, dtype=torch.uint8))
    assert OPS.dequant_block(y, scale)[2, 128:].isnan().all()
    y_ok, _ = OPS.dynamic_block_quant(x[:, :128])
    assert torch.equal(codes(y[:, :128]), codes(y_ok))


def tile_error_bound(v: torch.Tensor) -> torch.Tensor:
    """Half an e4m3 ulp at |v| (3 mantissa bits; binade 2^-6 below that: subnormals), plus 2^-22 |v| for the
    fp32 rounding of x / s that precedes the fp8 rounding."""
    binade = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -6)))
    return torch.exp2(binade - 4) + v.abs() * 2.0 ** -22


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(-(2.0 ** 60), 2.0 ** 60, allow_nan=False, width=32), min_size=128, max_size=128),
       scale_fmt=st.sampled_from(["fp32", "ue8m0"]))
def test_round_trip_error_is_within_half_ulp(values, scale_fmt):
    x = torch.tensor(values).view(2, 64)
    y, scale = OPS.dynamic_block_quant(x, block_size=64, scale_fmt=scale_fmt)
    s = scale.double().repeat_interleave(64, dim=-1)
    v = x.double() / s
    assert (v.abs() <= 448 * (1 + 2.0 ** -22)).all()
    assert ((y.double() - v).abs() <= tile_error_bound(v)).all()
    back = OPS.dequant_block(y, scale, block_size=64).double()
    assert ((back - x.double()).abs() <= s * tile_error_bound(v) + back.abs() * 2.0 ** -24).all()


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize(("shape", "block_size"), [((2, 256), 128), ((3, 4, 64), 64), ((5, 48), 48), ((0, 32), 32)])
def test_int8_codes_match_reference_and_round_trip_within_half_a_step(shape, block_size, scale_fmt):
    x = spread(shape, torch.float32, -30, 30, seed=block_size)
    y, scale = OPS.dynamic_block_quant(x, block_size=block_size, scale_fmt=scale_fmt, dst_type=torch.int8)
    y_ref, scale_ref = reference_dynamic_block_quant(x, block_size=block_size, scale_fmt=scale_fmt,
                                                     dst_type=torch.int8)
    assert y.dtype == torch.int8 and torch.equal(y, y_ref) and torch.equal(scale, scale_ref)
    assert bool((y.abs() <= 127).all())
    back = OPS.dequant_block(y, scale, block_size=block_size)
    assert torch.equal(back, reference_dequant_block(y, scale, block_size=block_size))
    step = scale.repeat_interleave(block_size, dim=-1)
    assert bool(((back - x).abs() <= step / 2 * (1 + 1e-6)).all())
    if scale_fmt == "fp32" and x.numel():     # the tile's largest magnitude maps to 127
        tile_max = y.abs().unflatten(-1, (-1, block_size)).amax(-1)
        assert torch.equal(tile_max, torch.full(scale.shape, 127, dtype=torch.int8))


def test_int8_nonfinite_tile_gets_nan_scale_and_zero_codes():
    x = torch.randn(3, 128)
    x[1, 5] = float("-inf")
    y, scale = OPS.dynamic_block_quant(x, dst_type=torch.int8)
    assert scale[1].isnan().all() and not scale[[0, 2]].isnan().any() and not y[1].any()
    assert OPS.dequant_block(y, scale)[1].isnan().all()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"block_size": 128}, "not divisible by `block_size`=128"),
    ({"block_size": 64, "dst_type": torch.uint8}, "dst_type"),
    ({"scale_fmt": "e8m0"}, "scale_fmt"),
    ({"block_size": -1}, "block_size"),
])
def test_quant_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OPS.dynamic_block_quant(torch.randn(4, 192), **kwargs)


def test_dequant_rejects_mismatched_inputs():
    y, scale = OPS.dynamic_block_quant(torch.randn(4, 256))
    with pytest.raises(ValueError, match=r"expected \(4, 2\)"):
        OPS.dequant_block(y, scale.t().contiguous())
    with pytest.raises(ValueError, match=r"`scale` has dtype torch\.float16"):
        OPS.dequant_block(y, scale.half())
    with pytest.raises(ValueError, match=r"`x` has dtype torch\.int64"):
        OPS.dynamic_block_quant(torch.ones(2, 128, dtype=torch.int64))


def test_opcheck():
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    torch.library.opcheck(OPS.dynamic_block_quant, (x,), {"block_size": 128, "scale_fmt": "ue8m0"})
    y, scale = OPS.dynamic_block_quant(x)
    # test_schema compares fp8 inputs with arithmetic torch lacks for fp8; check the no-mutation part by hand.
    before = codes(y).clone()
    torch.library.opcheck(OPS.dequant_block, (y, scale), {"dst_type": torch.bfloat16},
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    assert torch.equal(codes(y), before)


def test_inside_torch_compile_with_dynamic_shapes():
    def round_trip(x):
        y, scale = OPS.dynamic_block_quant(x, block_size=128, scale_fmt="ue8m0")
        return OPS.dequant_block(y, scale, block_size=128, dst_type=torch.float32) + 1

    compiled = torch.compile(round_trip, fullgraph=True, dynamic=True, backend="eager")
    for tokens in (3, 7):
        x = torch.randn(tokens, 2, 256)
        assert torch.equal(compiled(x), round_trip(x))

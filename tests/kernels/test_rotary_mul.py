"""ascend_dsa::rotary_mul: both CPU paths against the reference (torch_npu's documented formula) and bit for bit
against the unfused eager forms models write, over modes, dtypes, layouts and broadcasts; rotation laws
(norm of each pair kept, angle 0 is the identity, inverse angle undoes it); argument errors; torch.compile."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native_paths import LEVELS, require_built

from npu_graph.kernels.native import cpu_isa
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.rowwise import rotary_mul as rotary_module
from npu_graph.kernels.rowwise.rotary_mul import reference_rotary_mul

OPS = torch.ops.ascend_dsa
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MODES = ["half", "interleave"]
TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (2 ** -7, 1e-2), torch.float16: (2 ** -10, 1e-3)}
TORCH_PATHS = {"torch_few_rows": 1 << 30, "torch_halves": 0}

def angles(shape, g):
    """(cos, sin) of random angles, each [..., D/2]."""
    theta = torch.rand(shape, generator=g) * 2 * math.pi
    return theta.cos(), theta.sin()


def full_dim(half: torch.Tensor, mode: str) -> torch.Tensor:
    """An angle tensor [..., D/2] written for both members of each pair, as r1/r2 are."""
    return torch.cat((half, half), -1) if mode == "half" else torch.stack((half, half), -1).flatten(-2)


def unfused(x, cos, sin, mode):
    """The eager forms of the reference model (dsa.apply_rope): halves with cat, or pairs with stack."""
    if mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


@pytest.fixture(params=[*TORCH_PATHS, *(f"native-{level}" for level in LEVELS)])
def path(request, monkeypatch):
    """The torch path's few-rows and blocked forms (native kernels off), and the native kernel at each
    instruction-set level (forced on: fp16 keeps the torch path)."""
    if request.param in TORCH_PATHS:
        monkeypatch.setenv(native.ENV_SWITCH, "0")
        monkeypatch.setattr(rotary_module, "FEW_ELEMS", TORCH_PATHS[request.param])
        return request.param
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    monkeypatch.setenv(cpu_isa.ENV_ISA, request.param.removeprefix("native-"))
    require_built(rotary_module.NATIVE_SOURCE)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("shape", "angle_shape"), [((1, 1, 16, 64), (1, 1, 1, 32)), ((2, 7, 4, 32), (2, 7, 1, 16)),
                                                    ((2, 4, 7, 8), (1, 1, 7, 4)), ((3, 2, 5, 2), (3, 2, 5, 1)),
                                                    ((0, 3, 2, 16), (0, 3, 1, 8))])
def test_equals_unfused_form_bit_for_bit(path, dtype, mode, shape, angle_shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    cos, sin = (a.to(dtype) for a in angles(angle_shape, g))
    out = OPS.rotary_mul(x, full_dim(cos, mode), full_dim(sin, mode), rotary_mode=mode)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, unfused(x, cos, sin, mode))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference_with_unrelated_r1_r2(path, dtype, mode):
    """r1 and r2 need not be cosines and sines of one angle, nor equal across a pair."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 16, generator=g).to(dtype)
    r1, r2 = (torch.randn(2, 3, 1, 16, generator=g).to(dtype) for _ in range(2))
    out = OPS.rotary_mul(x, r1, r2, rotary_mode=mode)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, reference_rotary_mul(x, r1, r2, mode), rtol=rtol, atol=atol)


@pytest.mark.parametrize("mode", MODES)
def test_non_contiguous_input(path, mode):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 3, 16, generator=g).transpose(1, 2)
    r1, r2 = (torch.randn(1, 3, 1, 16, generator=g) for _ in range(2))
    out = OPS.rotary_mul(x, r1, r2, rotary_mode=mode)
    torch.testing.assert_close(out, reference_rotary_mul(x, r1, r2, mode))
    assert out.stride() == x.stride(), "a dense input's layout is kept, as elementwise ops keep it"
    part = x[..., :8]
    assert OPS.rotary_mul(part, r1[..., :8], r2[..., :8], rotary_mode=mode).stride() == torch.empty_like(part).stride()


@settings(max_examples=25, deadline=None)
@given(mode=st.sampled_from(MODES), half=st.integers(1, 12), rows=st.integers(1, 6), seed=st.integers(0, 2 ** 16))
def test_rotation_laws(mode, half, rows, seed):
    """A rotation keeps each pair's norm; angle 0 is the identity; rotating back by -angle restores x."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, rows, 2, 2 * half, generator=g, dtype=torch.float64).float()
    cos, sin = angles((1, rows, 1, half), g)
    y = OPS.rotary_mul(x, full_dim(cos, mode), full_dim(sin, mode), rotary_mode=mode)
    pair_norm = (lambda t: t.unflatten(-1, (2, half)).norm(dim=-2)) if mode == "half" else \
        (lambda t: t.unflatten(-1, (half, 2)).norm(dim=-1))
    torch.testing.assert_close(pair_norm(y), pair_norm(x), rtol=1e-5, atol=1e-5)
    identity = OPS.rotary_mul(x, torch.ones(1, 1, 1, 2 * half), torch.zeros(1, 1, 1, 2 * half), rotary_mode=mode)
    assert torch.equal(identity, x)
    back = OPS.rotary_mul(y, full_dim(cos, mode), full_dim(-sin, mode), rotary_mode=mode)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((torch.ones(2, 3, 4), torch.ones(2, 3, 4), torch.ones(2, 3, 4)), {}, "rank 4"),
    ((torch.ones(1, 1, 2, 5), torch.ones(1, 1, 1, 5), torch.ones(1, 1, 1, 5)), {}, "must be even"),
    ((torch.ones(1, 1, 2, 4), torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4)), {"rotary_mode": "rotate"},
     "rotary_mode"),
    ((torch.ones(1, 1, 2, 4), torch.ones(1, 1, 1, 4).bfloat16(), torch.ones(1, 1, 1, 4)), {}, "dtypes of `r1`"),
    ((torch.ones(1, 1, 2, 4), torch.ones(1, 1, 1, 4), torch.ones(1, 2, 1, 4)), {}, "does not broadcast"),
    ((torch.ones(1, 1, 2, 4, dtype=torch.int32),) * 3, {}, "dtype torch.int32"),
])
def test_bad_arguments_raise_clear_errors(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        OPS.rotary_mul(*args, **kwargs)


def test_compiles_with_fake_shapes():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 4, 16, generator=g)
    r1, r2 = (torch.randn(2, 5, 1, 16, generator=g) for _ in range(2))
    fn = torch.compile(lambda a, b, c: OPS.rotary_mul(a, b, c, rotary_mode="interleave"), backend="eager",
                       fullgraph=True)
    assert torch.equal(fn(x, r1, r2), OPS.rotary_mul(x, r1, r2, rotary_mode="interleave"))


NATIVE_CASES = [  # (x shape, angle shape, x's dim order): decode rows, a prefill with angles over heads, a tail
    ((1, 8, 1, 64), (1, 1, 1, 32), (0, 2, 1, 3)),      # past whole vectors, a transposed layout
    ((1, 512, 16, 64), (1, 512, 1, 32), (0, 1, 2, 3)),
    ((2, 3, 40, 36), (2, 3, 1, 18), (0, 2, 1, 3)),
    ((3, 5, 2, 2), (3, 5, 2, 1), (0, 1, 2, 3)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "angle_shape", "order"), NATIVE_CASES)
def test_native_kernel_equals_unfused_form_bit_for_bit(isa_level, dtype, shape, angle_shape, order):
    """fp32 and bf16 calls of any size and layout go to the native kernel (vector rows, their tails, split over
    threads for a prefill), whose result equals the unfused form's; a slice of the last dim takes the value by
    value rows."""
    require_built(rotary_module.NATIVE_SOURCE)
    g = torch.Generator().manual_seed(4)
    x = torch.randn([shape[i] for i in order], generator=g).to(dtype).permute(order)
    cos, sin = (a.to(dtype) for a in angles(angle_shape, g))
    for mode in MODES:
        r1, r2 = full_dim(cos, mode), full_dim(sin, mode)
        plan = rotary_module._native_plan(x, r1, r2, mode)
        assert plan is not None
        got = plan(x, r1, r2)
        assert got.stride() == torch.empty_like(x).stride()
        assert torch.equal(got, unfused(x, cos, sin, mode))
        wide = torch.cat((x, x), -1)[..., ::2]
        strided = rotary_module._native_plan(wide, r1, r2, mode)(wide, r1, r2)
        assert torch.equal(strided, unfused(wide, cos, sin, mode))


def test_native_kernel_takes_fp32_and_bf16_only():
    x = torch.randn(1, 4, 2, 8)
    ones = torch.ones(1, 4, 1, 8)
    assert rotary_module._native_plan(x.half(), ones.half(), ones.half(), "half") is None
    if native.available(rotary_module.NATIVE_SOURCE)[0]:
        assert rotary_module._native_plan(x.bfloat16(), ones.bfloat16(), ones.bfloat16(), "half") is not None

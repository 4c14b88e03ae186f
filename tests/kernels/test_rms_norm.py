"""ascend_dsa::rms_norm and ascend_dsa::add_rms_norm: fast path against the reference over dtypes, shapes and
edge values, the rstd contract, add_rms_norm == rms_norm(x1 + x2), scale invariance, errors, compile."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from npu_graph.kernels.native import loader as native
from npu_graph.kernels.rowwise import rms_norm as rms_module
from npu_graph.kernels.rowwise.rms_norm import reference_add_rms_norm, reference_rms_norm

OPS = torch.ops.ascend_dsa
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# y may differ from the reference by one rounding of the output dtype: the fast path sums squares in
# another order (its rstd agrees to a few fp32 ulps).
Y_TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2 ** -7, 1e-5), torch.float16: (2 ** -10, 1e-5)}


def assert_matches_reference(x, gamma, epsilon=1e-6):
    y, rstd = OPS.rms_norm(x, gamma, epsilon)
    y_ref, rstd_ref = reference_rms_norm(x, gamma, epsilon)
    assert y.dtype == x.dtype and rstd.dtype == torch.float32 and rstd.shape == rstd_ref.shape
    torch.testing.assert_close(rstd, rstd_ref, rtol=1e-6, atol=0, equal_nan=True)
    rtol, atol = Y_TOL[x.dtype]
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "gamma_shape"), [((4, 64), (64,)), ((2, 3, 128), (128,)), ((2, 3, 128), (3, 128)),
                                                    ((1, 1, 7), (7,)), ((5, 1), (1,)), ((0, 32), (32,)),
                                                    ((70, 512), (512,))])
@pytest.mark.parametrize(("few_rows_elems", "native_on"), [(0, True), (0, False), (1 << 30, True), (1 << 30, False)],
                         ids=["native", "blocked_torch", "few_rows_native", "few_rows_torch"])
def test_fast_matches_reference(dtype, shape, gamma_shape, few_rows_elems, native_on, isa_level, monkeypatch):
    monkeypatch.setattr(rms_module, "FEW_ROWS_ELEMS", few_rows_elems)
    if not native_on:
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    gamma = (torch.rand(gamma_shape, generator=g) + 0.5).to(dtype)
    assert_matches_reference(x, gamma)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make", [lambda t: t[..., :40], lambda t: t[:, ::2, :40],
                                  lambda t: t[:, :1, :40].expand(3, 6, 40), lambda t: t.transpose(0, 1)[..., :40]],
                         ids=["sliced_rows", "every_other_row", "broadcast_row", "transposed"])
def test_rows_read_in_place_where_evenly_spaced(dtype, make, isa_level):
    """The native kernel reads a slice of a wider last dimension (an MLA layer's compressed kv) without a copy."""
    x = make((torch.randn(3, 12, 48) * 2).to(dtype))
    gamma = (torch.rand(40) + 0.5).to(dtype)
    assert_matches_reference(x, gamma)
    assert OPS.rms_norm(x, gamma)[0].is_contiguous()


def test_rstd_keeps_the_normalized_dimensions_as_one():
    x = torch.randn(2, 3, 4, 8)
    assert OPS.rms_norm(x, torch.ones(8))[1].shape == (2, 3, 4, 1)
    assert OPS.rms_norm(x, torch.ones(4, 8))[1].shape == (2, 3, 1, 1)


def test_bf16_input_with_fp32_gamma_and_a_larger_epsilon():
    x = torch.randn(6, 96).bfloat16()
    assert_matches_reference(x, torch.rand(96) + 0.5, epsilon=1e-2)


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_values(dtype, native_on, isa_level, monkeypatch):
    if not native_on:
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    big = 1e30 if dtype == torch.float32 else 6e4
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [float("nan"), 1, 2, 3], [float("inf"), 1, 2, 3], [big, -big, 1, 2],
                      [1e-30, 0, 0, 0], [1e-3, -2e-3, 5e-4, 0]]).to(dtype)
    gamma = torch.ones(4, dtype=dtype)
    assert_matches_reference(x, gamma)
    y, rstd = OPS.rms_norm(x, gamma)
    assert not y[0].any() and rstd[0].item() == pytest.approx(1e3, rel=1e-6)
    assert y[1].isnan().all() and torch.isfinite(y[5]).all()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 80), shift=st.integers(-20, 20), seed=st.integers(0, 2 ** 16))
def test_output_is_invariant_under_power_of_two_scaling(rows, n, shift, seed):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)) + 0.01
    gamma = torch.rand(n) + 0.5
    y, rstd = OPS.rms_norm(x, gamma, 0.0)
    y_scaled, rstd_scaled = OPS.rms_norm(x * 2.0 ** shift, gamma, 0.0)
    torch.testing.assert_close(y_scaled, y, rtol=1e-6, atol=0)
    torch.testing.assert_close(rstd_scaled * 2.0 ** shift, rstd, rtol=1e-6, atol=0)
    torch.testing.assert_close((y / gamma).pow(2).mean(-1), torch.ones(rows), rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 64), (5, 70), (2, 70, 512), (300, 300)])   # vector tails; parallel rows
def test_add_rms_norm_equals_rms_norm_of_the_sum(dtype, shape, isa_level):
    g = torch.Generator().manual_seed(1)
    x1, x2 = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    gamma = torch.rand(shape[-1], generator=g).to(dtype)
    y, rstd, x = OPS.add_rms_norm(x1, x2, gamma, 1e-5)
    assert torch.equal(x, x1 + x2)
    y_alone, rstd_alone = OPS.rms_norm(x1 + x2, gamma, 1e-5)
    assert torch.equal(y, y_alone) and torch.equal(rstd, rstd_alone)
    y_ref, rstd_ref, x_ref = reference_add_rms_norm(x1, x2, gamma, 1e-5)
    assert torch.equal(x, x_ref)
    torch.testing.assert_close(y, y_ref, rtol=Y_TOL[dtype][0], atol=Y_TOL[dtype][1])
    torch.testing.assert_close(rstd, rstd_ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize(("args", "match"), [
    ((torch.randn(4, 8), torch.ones(6)), r"`gamma` of shape \(6,\) must equal the trailing dimensions"),
    ((torch.randn(4, 8), torch.ones(2, 4, 8)), "`gamma` must have rank 1..2"),
    ((torch.randn(4, 8).bfloat16(), torch.ones(8).half()), "`gamma` has dtype torch.float16"),
    ((torch.ones(4, 8, dtype=torch.int32), torch.ones(8)), "`x` has dtype torch.int32"),
    ((torch.randn(4, 8), torch.ones(8), -1.0), "`epsilon` must be >= 0"),
    ((torch.randn(4, 0), torch.ones(0)), "is empty; there is nothing to normalize"),
])
def test_rms_norm_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        OPS.rms_norm(*args)


def test_add_rms_norm_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="shapes of `x1` and `x2` disagree"):
        OPS.add_rms_norm(torch.randn(4, 8), torch.randn(2, 8), torch.ones(8))
    with pytest.raises(ValueError, match="dtypes of `x1` and `x2` disagree"):
        OPS.add_rms_norm(torch.randn(4, 8), torch.randn(4, 8).half(), torch.ones(8))


def test_opcheck():
    x = torch.randn(2, 3, 16, dtype=torch.bfloat16)
    gamma = torch.rand(16, dtype=torch.bfloat16)
    torch.library.opcheck(OPS.rms_norm, (x, gamma, 1e-5))
    torch.library.opcheck(OPS.add_rms_norm, (x, torch.randn_like(x), gamma, 1e-5))


def test_inside_torch_compile_with_dynamic_shapes():
    def block(h, residual, gamma):
        y, _, x = OPS.add_rms_norm(h, residual, gamma, 1e-6)
        out, _ = OPS.rms_norm(y * 2, gamma, 1e-6)
        return out, x

    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend="eager")
    gamma = torch.rand(64)
    for tokens in (3, 9):
        h, residual = torch.randn(tokens, 64), torch.randn(tokens, 64)
        for got, want in zip(compiled(h, residual, gamma), block(h, residual, gamma)):
            assert torch.equal(got, want)


def test_results_do_not_depend_on_the_row_block_size(monkeypatch):
    monkeypatch.setattr(rms_module, "FEW_ROWS_ELEMS", 0)
    x1, x2 = torch.randn(37, 96).bfloat16(), torch.randn(37, 96).bfloat16()
    gamma = torch.rand(96).bfloat16()
    whole = (*OPS.rms_norm(x1, gamma), *OPS.add_rms_norm(x1, x2, gamma))
    monkeypatch.setattr(rms_module, "CHUNK_ELEMS", 96 * 5)      # blocks of 5 rows, the last one short
    split = (*OPS.rms_norm(x1, gamma), *OPS.add_rms_norm(x1, x2, gamma))
    for a, b in zip(whole, split):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [6, 5120])     # the few-rows path and the blocked one
def test_outputs_are_contiguous_for_permuted_inputs_as_the_fakes_say(dtype, rows):
    """Inductor checks that what it calls has the strides the fake promised."""
    def permuted():
        return torch.randn(4, rows, 32).transpose(0, 1).to(dtype)

    x1, x2, gamma = permuted(), permuted(), torch.randn(32, dtype=dtype)
    torch.library.opcheck(torch.ops.ascend_dsa.rms_norm.default, (x1, gamma, 1e-6))
    torch.library.opcheck(torch.ops.ascend_dsa.add_rms_norm.default, (x1, x2, gamma, 1e-6))
    torch.library.opcheck(torch.ops.ascend_dsa.add_rms_norm.default, (x1.contiguous(), x2, gamma, 1e-6))


def test_native_class_reads_layouts_of_fake_tensors():
    """The compile report asks for the class of a sliced x with the graph's fake tensors (another fake mode)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(1, 16, 48)[..., :40]
        gamma = torch.empty(40)
    assert rms_module.native_class(x, gamma) == rms_module.native_class(torch.empty(1, 16, 48)[..., :40],
                                                                         torch.empty(40))
    assert rms_module._row_stride(x, 1) == 48 and rms_module._row_stride(torch.empty(4, 6).t(), 1) is None

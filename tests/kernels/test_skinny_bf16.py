"""The bf16 decode products (kernels/aten/skinny_bf16.py, native/skinny_mm.c's sm_gemv_bf16) at every
instruction-set level: aten.mm's x @ w with the weight as [K, N] or as the transposed view of an [N, K] weight,
aten.bmm's batched form, Inductor's mm into out buffers; within bf16 rounding of fp32 sums of the exact product;
what they do not take goes to torch unchanged; the runtime binds aten.bmm to them."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from native_paths import refuse

from npu_graph.kernels.aten import skinny_bf16, skinny_bmm, skinny_mm
from npu_graph.kernels.native import loader as native

LOADED, WHY = native.available(skinny_mm.NATIVE_SOURCE)
needs_native = pytest.mark.skipif(not LOADED, reason=f"native kernel not available: {WHY}")
pytestmark = pytest.mark.usefixtures("isa_level")


def assert_within_bf16_rounding(out, x, w):
    """|out - x @ w| <= 2^-8·|x @ w| + 2·K·2^-24·(|x| @ |w|), exact product in float64: a bf16 result (rounded to
    nearest: at most half an ulp, 2^-8 of its magnitude) of fp32 sums in any order (K·2^-24 of the magnitudes'
    sum; doubled for the rounding of pairs of products)."""
    exact = x.double() @ w.double()
    sums = 2 * x.shape[-1] * 2.0 ** -24 * (x.double().abs() @ w.double().abs())
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    assert ((out.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + sums + 1e-30).all()


def bf16(*shape, g):
    return torch.randn(*shape, generator=g).bfloat16()


def weight(inner, cols, transposed, g, batch=()):
    """A bf16 weight [*batch, inner, cols]: row-major, or the transposed view of a [*batch, cols, inner] one."""
    return bf16(*batch, cols, inner, g=g).transpose(-1, -2) if transposed else bf16(*batch, inner, cols, g=g)


@pytest.fixture
def native_only(monkeypatch):
    """Native kernels forced (no measurement) and the torch fallbacks raising: the native kernel did the work.
    Its value is the monkeypatch, for more of them."""
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    refuse(monkeypatch, skinny_mm, "_aten_mm", "_aten_mm_out", said="fell back to torch")
    refuse(monkeypatch, skinny_bmm, "_aten_bmm", said="fell back to torch")
    return monkeypatch


@needs_native
@pytest.mark.parametrize("transposed", [True, False], ids=["nk", "kn"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("inner", "cols"), [(512, 256), (7, 33), (1, 1), (33, 5), (300, 1001), (5, 2048 + 37),
                                             (517, 1100)])
def test_products_match_the_exact_one(rows, inner, cols, transposed, native_only):
    """Tails of k and n, more columns than one block of the [K, N] form, and a weight large enough for threads."""
    g = torch.Generator().manual_seed(rows * inner + cols)
    x, w = bf16(rows, inner, g=g), weight(inner, cols, transposed, g)
    assert_within_bf16_rounding(skinny_mm.mm(x, w), x, w)


@needs_native
@pytest.mark.parametrize("rows", [1, 3])
def test_linear_layers_weights_as_stored(rows, native_only):
    """skinny_mm.linear (fused_moe's decode experts): x @ w.T for a bf16 [N, K] weight, read as stored."""
    refuse(native_only, skinny_mm.F, "linear", said="fell back to torch")
    g = torch.Generator().manual_seed(rows)
    x, w = bf16(rows, 517, g=g), bf16(300, 517, g=g)
    for _ in range(2):                                                 # the first call, then the plan
        assert_within_bf16_rounding(skinny_mm.linear(x, w), x, w.t())


@needs_native
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(1, 6), rows=st.integers(1, 4), inner=st.integers(1, 70), cols=st.integers(1, 70),
       transposed=st.booleans(), pad=st.integers(0, 9), seed=st.integers(0, 2 ** 16))
def test_batched_products_with_strided_operands(batch, rows, inner, cols, transposed, pad, seed, native_only):
    """x's rows and batches `pad` values apart beyond their length, as MLA's query slices are; weights in either
    layout with their batches padded too. (The fixture's settings hold for every example.)"""
    g = torch.Generator().manual_seed(seed)
    x = bf16(batch, rows + 1, inner + pad, g=g)[:, :rows, :inner]
    w = weight(inner + pad, cols, transposed, g, (batch,))[:, :inner]
    assert_within_bf16_rounding(skinny_bmm.bmm(x, w), x, w)
    assert_within_bf16_rounding(skinny_mm.mm(x[0], w[0]), x[0], w[0])


@needs_native
def test_products_are_native_and_match_torch(native_only):
    """The absorbed MLA shapes, scaled down: native, and within one bf16 ulp of what aten.bmm rounds."""
    g = torch.Generator().manual_seed(3)
    q = bf16(16, 1, 96, g=g)[:, :, :64]                   # a slice of a wider query, as the graph passes it
    w_uk, w_uv = bf16(16, 64, 128, g=g), bf16(16, 32, 128, g=g).transpose(1, 2)
    for x, w in [(q, w_uk), (bf16(16, 1, 128, g=g), w_uv)]:
        out, aten = skinny_bmm.bmm(x, w), torch.bmm(x, w)
        assert_within_bf16_rounding(out, x, w)
        assert ((out.float() - aten.float()).abs() <= 2.0 ** -7 * aten.float().abs() + 1e-2).all()


@needs_native
@pytest.mark.parametrize("transposed", [True, False], ids=["nk", "kn"])
def test_products_into_inductors_out_buffers(transposed, native_only):
    g = torch.Generator().manual_seed(4)
    x, w = bf16(2, 96, g=g), weight(96, 40, transposed, g)
    out = torch.empty(2, 48, dtype=torch.bfloat16)[:, :40]           # rows 48 apart
    site = skinny_mm.native_out_callable()
    for _ in range(2):                                                 # the first call, then the plan
        assert site(x, w, out=out) is out
        assert_within_bf16_rounding(out, x, w)


@pytest.mark.parametrize("case", ["fp32_weight", "five_rows", "no_unit_stride", "transposed_x", "empty", "grad"])
def test_other_products_are_torch_unchanged(case):
    g = torch.Generator().manual_seed(1)
    x, w = bf16(2, 16, g=g), bf16(16, 8, g=g)
    if case == "fp32_weight":
        x, w = x.float(), w.float()
    elif case == "five_rows":
        x = bf16(5, 16, g=g)
    elif case == "no_unit_stride":
        w = bf16(16, 16, g=g)[:, ::2]
    elif case == "transposed_x":
        x = bf16(16, 2, g=g).t()
    elif case == "empty":
        x = bf16(0, 16, g=g)
    else:
        w.requires_grad_()
    assert skinny_bf16.takes(x, w) is False
    if case != "fp32_weight":               # fp32 products are skinny_mm's own (tests/kernels/test_skinny_mm.py)
        assert torch.equal(skinny_mm.mm(x, w), torch.mm(x, w))
    assert torch.equal(skinny_bmm.bmm(x[None], w[None]), torch.bmm(x[None], w[None]))


def test_bf16_classes_are_apart_from_fp32_and_by_layout():
    x = torch.empty(1, 64, dtype=torch.bfloat16)
    plain, transposed = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(32, 64, dtype=torch.bfloat16).t()
    classes = {skinny_bf16.shape_class(x, plain, False), skinny_bf16.shape_class(x, transposed, False),
               skinny_bf16.shape_class(x, plain, True)}
    assert len(classes) == 3 and all(cls[0] == "bf16" for cls in classes)


def test_a_weights_span_counts_every_layout():
    """The bytes a product reads from (what is evicted before a measurement, and what makes a weight streamed): the
    same for a weight and its transposed view, and for a batch of them."""
    w = torch.empty(8, 64, 32, dtype=torch.bfloat16)
    assert skinny_mm._span_bytes(w) == skinny_mm._span_bytes(w.transpose(1, 2)) == w.numel() * 2
    assert skinny_mm._span_bytes(w[0, :, :16]) == (63 * 32 + 16) * 2


@needs_native
def test_measured_dispatch_keeps_the_faster_path(monkeypatch, dispatch_table):
    """In auto mode each bf16 class is measured (apart from fp32's) and the plan follows the choice."""
    from npu_graph.kernels.native import dispatch

    monkeypatch.setattr(dispatch, "CLOSE", 1.0)
    g = torch.Generator().manual_seed(6)
    x, w = bf16(1, 256, g=g), weight(256, 64, True, g)
    assert_within_bf16_rounding(skinny_mm.mm(x, w), x, w)
    xb, wb = bf16(4, 1, 64, g=g), weight(64, 32, False, g, (4,))
    assert_within_bf16_rounding(skinny_bmm.bmm(xb, wb), xb, wb)
    classes = {key[0]: key[2] for key in dispatch._known}
    assert classes["skinny_mm"][:2] == ("bf16", "nk") and classes["skinny_bmm"][:2] == ("bf16", "kn")


def test_the_runtime_binds_bmm(monkeypatch):
    """Generated sources' aten.bmm calls are bound to the native product where the library loads, else aten.bmm."""
    from npu_graph.runtime.direct_calls import DIRECT
    from npu_graph.targets.cpu_bindings import bind_source

    assert "_bind.native('skinny_bmm', 'bmm', 'default')" in bind_source("y = torch.ops.aten.bmm.default(a, b)\n")
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert skinny_bmm.native_callable() is None
    assert DIRECT.native("skinny_bmm", "bmm", "default") is not None
    monkeypatch.delenv(native.ENV_SWITCH)
    if LOADED:
        assert skinny_bmm.native_callable() is skinny_bmm.bmm

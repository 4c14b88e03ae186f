"""kernels/aten/skinny_mm: the native decode-sized products (x @ w and x @ w.T for at most 4 rows of fp32) within the
error bound of fp32 summation of the exact product, on random inputs, odd sizes and strided operands;
everything else falls back to torch unchanged; the runtime binding of the generated source's aten.mm calls."""
import pytest
import torch
import torch.nn.functional as F
from native_paths import refuse

from npu_graph.kernels.aten import skinny_mm
from npu_graph.kernels.native import loader as native

LOADED, WHY = native.available(skinny_mm.NATIVE_SOURCE)
needs_native = pytest.mark.skipif(not LOADED, reason=f"native kernel not available: {WHY}")
pytestmark = pytest.mark.usefixtures("isa_level")


def assert_within_fp32_summation_bound(out, x, w):
    """|out - x @ w| <= K·u·(|x| @ |w|), exact product in float64: the bound of fp32 sums in any order."""
    exact = x.double() @ w.double()
    bound = x.shape[1] * 2.0 ** -24 * (x.double().abs() @ w.double().abs()) + 1e-30
    assert out.dtype == torch.float32 and out.shape == exact.shape
    assert ((out.double() - exact).abs() <= bound).all()


def no_torch_fallback(monkeypatch):
    """Make the torch fallbacks raise, so a test shows that the native kernel did the work."""
    refuse(monkeypatch, skinny_mm, "_aten_mm", said="fell back to torch")
    refuse(monkeypatch, skinny_mm.F, "linear", said="fell back to torch")


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("inner", "cols"), [(512, 512), (7, 33), (1, 1), (300, 1000), (64, 16)])
def test_native_products_match_torch(rows, inner, cols, monkeypatch):
    g = torch.Generator().manual_seed(rows * inner + cols)
    x = torch.randn(rows, inner, generator=g)
    w = torch.randn(inner, cols, generator=g)
    w_nt = torch.randn(cols, inner, generator=g)
    no_torch_fallback(monkeypatch)
    assert_within_fp32_summation_bound(skinny_mm.mm(x, w), x, w)
    assert_within_fp32_summation_bound(skinny_mm.linear(x, w_nt), x, w_nt.t())


@needs_native
def test_strided_rows(monkeypatch):
    """Rows of x and w taken from wider tensors (row strides larger than the row) are read in place."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 100, generator=g)[:, 10:74]
    w = torch.randn(64, 90, generator=g)[:, 5:45]
    w_nt = torch.randn(40, 80, generator=g)[:, 8:72]
    no_torch_fallback(monkeypatch)
    assert_within_fp32_summation_bound(skinny_mm.mm(x, w), x, w)
    assert_within_fp32_summation_bound(skinny_mm.linear(x, w_nt), x, w_nt.t())


@pytest.mark.parametrize("case", ["bf16", "five_rows", "column_major_weight", "transposed_x", "empty"])
def test_other_products_are_torch_unchanged(case):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 16, generator=g), torch.randn(16, 8, generator=g)
    if case == "bf16":
        x, w = x.bfloat16(), w.bfloat16()
    elif case == "five_rows":
        x = torch.randn(5, 16, generator=g)
    elif case == "column_major_weight":
        w = torch.randn(8, 16, generator=g).t()
    elif case == "transposed_x":
        x = torch.randn(16, 2, generator=g).t()
    else:
        x = torch.randn(0, 16)
    assert torch.equal(skinny_mm.mm(x, w), torch.mm(x, w))


def test_switched_off_and_autograd_use_torch(monkeypatch):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(1, 32, generator=g), torch.randn(32, 8, generator=g, requires_grad=True)
    out = skinny_mm.mm(x, w)
    out.sum().backward()
    assert out.requires_grad and torch.equal(w.grad, x.t().expand(32, 8))
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    plain = w.detach()
    assert torch.equal(skinny_mm.mm(x, plain), torch.mm(x, plain))
    assert torch.equal(skinny_mm.linear(x, plain.t().contiguous()), F.linear(x, plain.t().contiguous()))


def test_native_callable_is_what_the_runtime_binds_mm_to(monkeypatch):
    """The native product where the library loads, None when switched off (the runtime then binds aten.mm)."""
    from npu_graph.runtime.direct_calls import DIRECT
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert skinny_mm.native_callable() is None
    assert DIRECT.native("skinny_mm", "mm", "default") is not None
    monkeypatch.delenv(native.ENV_SWITCH)
    if not LOADED:
        return
    x, w = torch.randn(2, 8), torch.randn(8, 4)
    assert_within_fp32_summation_bound(skinny_mm.native_callable()(x, w), x, w)


def test_core_cache_size_from_sysfs(tmp_path):
    for index, (level, size) in enumerate([("1", "32K"), ("2", "512K"), ("3", "32768K")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "level").write_text(level + "\n")
        (folder / "size").write_text(size + "\n")
    assert skinny_mm.core_cache_bytes(str(tmp_path)) == 512 << 10
    assert skinny_mm.core_cache_bytes(str(tmp_path / "missing")) == 1 << 20


def test_weights_of_half_a_core_cache_are_measured_streamed():
    half = skinny_mm.core_cache_bytes() // 2
    assert skinny_mm._streamed(torch.empty(half // 4 // 256, 256))
    assert not skinny_mm._streamed(torch.empty(half // 4 // 256 - 1, 256))
    padded = torch.empty(half // 4 // 512 + 1, 512)[:, :256]       # rows padded to 512: the span counts
    assert skinny_mm._streamed(padded)


@needs_native
def test_streamed_products_are_measured_with_the_weight_evicted(monkeypatch, dispatch_table):
    from npu_graph.kernels.native import dispatch

    monkeypatch.setattr(dispatch, "CLOSE", 1.0)         # the first measurement decides, however close
    evicted = []
    real = skinny_mm._evictor
    monkeypatch.setattr(skinny_mm, "_evictor", lambda lib, w: lambda: evicted.append(real(lib, w)()))
    x = torch.randn(1, 512)
    w = torch.randn(512, skinny_mm.core_cache_bytes() // 4 // 512)
    assert_within_fp32_summation_bound(skinny_mm.mm(x, w), x, w)
    assert evicted and set(evicted) <= {0, 1}       # 1: evicted (x86 clflush), 0: no such instruction
    (key,) = [k for k in dispatch._known if k[0] == "skinny_mm"]
    assert key[2][-1] == "streamed"
    small = torch.randn(512, 16)
    evicted.clear()
    skinny_mm.mm(x, small)
    assert not evicted


@needs_native
@pytest.mark.parametrize("rows", [1, 3])
def test_products_into_inductors_out_buffers(rows, monkeypatch):
    """Inductor's extern_kernels.mm(x, w, out=buf), as the runtime binds it: the native product written into buf
    (a one-row buf may have any row stride, as Inductor's reinterpreted buffers do); a buf the kernel cannot write
    (rows not one after another) gets torch.mm into it."""
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(96, 40, generator=g)
    mm_out = skinny_mm.native_out_callable()
    out = torch.empty(rows, 40).as_strided((rows, 40), (0 if rows == 1 else 40, 1))
    refuse(monkeypatch, skinny_mm, "_aten_mm_out", said="fell back to torch")
    for _ in range(2):                                 # the first call, then the plan
        assert mm_out(x, w, out=out) is out
        assert_within_fp32_summation_bound(out, x, w)
    monkeypatch.undo()
    padded = torch.empty(rows, 48)[:, :40]             # rows 48 apart
    mm_out(x, w, out=padded)
    torch.testing.assert_close(padded, x @ w)


@needs_native
def test_a_call_site_plans_again_when_its_call_changes(monkeypatch):
    """One call site's binding keeps its last call's plan; a call of other sizes or strides is planned afresh,
    and while a profiler records, the site takes the full path, whose event names the implementation."""
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    site, g = skinny_mm.native_out_callable(), torch.Generator().manual_seed(5)
    for rows, cols, row_stride in [(1, 40, 40), (1, 40, 40), (2, 40, 40), (1, 24, 0), (2, 40, 48), (1, 40, 40)]:
        x, w = torch.randn(rows, 96, generator=g), torch.randn(96, cols, generator=g)
        out = torch.empty(rows, row_stride or cols).as_strided((rows, cols), (row_stride, 1))
        assert site(x, w, out=out) is out
        torch.testing.assert_close(out, x @ w, rtol=1e-5, atol=1e-5)
    with torch.profiler.profile() as prof:
        site(x, w, out=out)
    assert any(e.name.startswith("ascend_dsa::skinny_mm/native") for e in prof.events())

"""kernels/aten/depthwise_conv1d: the native depthwise 1-D convolution agrees with aten.convolution within the error
bound of fp32 sums and returns aten's output strides, for many channel counts, kernel sizes, paddings, lengths, batches
and layouts (contiguous, channels-last, strided views); every other convolution, and every convolution with
ASCEND_DSA_NATIVE=0, goes to aten unchanged; the runtime binds the generated source's aten.convolution calls."""
import pytest
import torch
from native_paths import at_each_level, refuse

from npu_graph.kernels.aten import depthwise_conv1d
from npu_graph.kernels.native import loader as native
from npu_graph.runtime.compiled_graph import CompiledGraph
from npu_graph.targets.cpu_bindings import bind_source

LOADED, WHY = native.available(depthwise_conv1d.NATIVE_SOURCE)
needs_native = pytest.mark.skipif(not LOADED, reason=f"native kernel not available: {WHY}")
ATEN = torch.ops.aten.convolution.default


def depthwise_args(bias, padding, channels):
    return (bias, [1], [padding], [1], False, [0], channels)


def check_against_aten(x, w, bias, padding):
    """The native result, at every instruction-set level this CPU can execute, has aten's shape, dtype and strides,
    and is within the fp32 bound of the exact sum: |out - exact| <= 2·(K+1)·u·(Σ|w·x| + |bias|) (ours and
    oneDNN's rounding), exact in float64 (computed once: it is the costly part)."""
    channels = w.shape[0]
    ref = ATEN(x, w, *depthwise_args(bias, padding, channels))
    as64 = (None if bias is None else bias.double(), [1], [padding], [1], False, [0], channels)
    exact = ATEN(x.double(), w.double(), *as64)
    magnitude = ATEN(x.double().abs(), w.double().abs(), None if bias is None else bias.double().abs(), *as64[1:])
    bound = 2 * (w.shape[2] + 1) * 2.0 ** -24 * magnitude + 1e-30
    for level in at_each_level():
        out = depthwise_conv1d.conv1d(x, w, bias, *depthwise_args(bias, padding, channels)[1:])
        assert (out.shape, out.stride(), out.dtype) == (ref.shape, ref.stride(), ref.dtype), level
        assert ((out.double() - exact).abs() <= bound).all(), level


def refuse_aten(monkeypatch):
    """Make the aten fallback raise, so a test shows that the native kernel did the work."""
    refuse(monkeypatch, depthwise_conv1d, "_aten_conv", said="fell back to aten")


def refuse_native(monkeypatch):
    """Make the native kernel raise, so a test shows that aten did the work."""
    def took_native(*args, **kwargs):
        raise AssertionError("took the native kernel")
    monkeypatch.setattr(depthwise_conv1d, "_typed", lambda lib: took_native)


@needs_native
@pytest.mark.parametrize("channels", [1, 3, 17, 64, 192, 300])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_native_matches_aten(channels, layout, monkeypatch):
    g = torch.Generator().manual_seed(channels)
    refuse_aten(monkeypatch)
    for batch in (1, 3):
        for length in (1, 7, 2048):
            x = torch.randn(batch, channels, length, generator=g)
            if layout == "channels_last":
                x = torch.randn(batch, length, channels, generator=g).transpose(1, 2)
            for kernel in range(1, 6):
                for padding in sorted({0, kernel - 1, kernel + 2}):
                    if length + 2 * padding < kernel:
                        continue
                    w = torch.randn(channels, 1, kernel, generator=g)
                    check_against_aten(x, w, None, padding)
                    check_against_aten(x, w, torch.randn(channels, generator=g), padding)


@needs_native
@pytest.mark.parametrize("view", ["time_strided", "channel_strided", "batch_broadcast", "permuted_batch",
                                  "weight_transposed", "weight_unit_stride_dim1", "bias_strided",
                                  "one_step_channels_last"])
def test_strided_views(view, monkeypatch):
    """Operands taken from other tensors are read in place through their strides; the output strides are aten's
    (channels-last for a one-step channels-last input, and for a weight whose strides read as channels-last)."""
    g = torch.Generator().manual_seed(3)
    x, w, bias = torch.randn(2, 40, 33, generator=g), torch.randn(40, 1, 4, generator=g), None
    if view == "time_strided":
        x = torch.randn(2, 40, 70, generator=g)[:, :, 1::2]
    elif view == "channel_strided":
        x = torch.randn(2, 80, 33, generator=g)[:, ::2]
    elif view == "batch_broadcast":
        x = torch.randn(1, 40, 33, generator=g).expand(3, 40, 33)
    elif view == "permuted_batch":
        x = torch.randn(33, 2, 40, generator=g).permute(1, 2, 0)
    elif view == "weight_transposed":
        w = torch.randn(4, 40, generator=g).t().unsqueeze(1)
    elif view == "weight_unit_stride_dim1":
        w = torch.randn(40, 4, generator=g).as_strided((40, 1, 4), (4, 1, 1))
    elif view == "bias_strided":
        bias = torch.randn(80, generator=g)[::2]
    else:
        x = torch.randn(2, 1, 40, generator=g).transpose(1, 2)
    refuse_aten(monkeypatch)
    for padding in (3, 5):
        check_against_aten(x, w, bias, padding)


@pytest.mark.parametrize("case", ["bf16", "float64", "dense", "grouped", "multiplier", "stride2", "dilation2",
                                  "transposed", "batch0", "autograd"])
def test_other_convolutions_take_aten(case, monkeypatch):
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 8, 20, generator=g), torch.randn(8, 1, 3, generator=g)
    args = [None, [1], [2], [1], False, [0], 8]
    if case in ("bf16", "float64"):
        dtype = torch.bfloat16 if case == "bf16" else torch.float64
        x, w = x.to(dtype), w.to(dtype)
    elif case == "dense":
        w, args[6] = torch.randn(8, 8, 3, generator=g), 1
    elif case == "grouped":
        w, args[6] = torch.randn(8, 2, 3, generator=g), 4
    elif case == "multiplier":
        w = torch.randn(16, 1, 3, generator=g)
    elif case == "stride2":
        args[1] = [2]
    elif case == "dilation2":
        args[3] = [2]
    elif case == "transposed":
        args[4] = True
    elif case == "batch0":
        x = torch.randn(0, 8, 20)
    else:
        w.requires_grad_(True)
    refuse_native(monkeypatch)
    out = depthwise_conv1d.conv1d(x, w, *args)
    ref = ATEN(x, w, *args)
    assert torch.equal(out, ref) and out.stride() == ref.stride() and out.requires_grad == ref.requires_grad


@pytest.mark.parametrize(("length", "kernel", "padding"), [(3, 4, 0), (1, 5, 1), (0, 2, 3)])
def test_no_output_steps_raise_as_aten(length, kernel, padding, monkeypatch):
    """Zero output steps (or an empty sequence) are aten's errors, unchanged."""
    x, w = torch.randn(1, 6, length), torch.randn(6, 1, kernel)
    refuse_native(monkeypatch)
    with pytest.raises(RuntimeError) as ours:
        depthwise_conv1d.conv1d(x, w, *depthwise_args(None, padding, 6))
    with pytest.raises(RuntimeError) as theirs:
        ATEN(x, w, *depthwise_args(None, padding, 6))
    assert str(ours.value) == str(theirs.value)


def test_switched_off_takes_aten(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    refuse_native(monkeypatch)
    x, w = torch.randn(1, 2048, 192).transpose(1, 2), torch.randn(192, 1, 4)
    args = depthwise_args(None, 3, 192)
    assert torch.equal(depthwise_conv1d.conv1d(x, w, *args), ATEN(x, w, *args))
    assert depthwise_conv1d.native_callable() is None


def test_native_callable_takes_convolutions():
    """What the runtime binds the graph's aten.convolution calls to (npu_graph.runtime.direct_calls)."""
    conv = depthwise_conv1d.native_callable()
    if not LOADED:
        assert conv is None
        return
    x, w = torch.randn(1, 2048, 192).transpose(1, 2), torch.randn(192, 1, 4)
    args = depthwise_args(None, 3, 192)
    torch.testing.assert_close(conv(x, w, *args), ATEN(x, w, *args), rtol=1e-5, atol=1e-5)


@needs_native
def test_runtime_binds_convolutions(monkeypatch):
    """A CompiledGraph runs its aten.convolution calls through the native kernel, as its source says."""
    source = ("def forward(self, x, w):\n"
              "    y = torch.ops.aten.convolution.default(x, w, None, [1], [3], [1], False, [0], 64)\n"
              "    return (torch.ops.aten.slice.Tensor(y, 2, 0, 100),)\n")
    graph = CompiledGraph("conv", bind_source(source), {"torch": torch}, {})
    assert "_native_depthwise_conv1d(x, w, None" in graph.source
    x, w = torch.randn(2, 100, 64).transpose(1, 2), torch.randn(64, 1, 4)
    ref = ATEN(x, w, *depthwise_args(None, 3, 64))[:, :, :100]
    refuse_aten(monkeypatch)
    (out,) = graph([x, w])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

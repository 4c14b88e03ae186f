"""short_depthwise_conv: decode-sized depthwise conv1d becomes shifted multiply-adds; other convs are kept."""
import pytest
import torch
import torch.nn.functional as F

from npu_graph.passes import short_depthwise_conv


@pytest.mark.parametrize("steps,kernel,bias", [(1, 4, False), (3, 4, True), (16, 3, False)])
def test_short_depthwise_conv_is_rewritten(watch_pass, steps, kernel, bias):
    g = torch.Generator().manual_seed(steps)
    x = torch.randn(2, 24, steps + kernel - 1, generator=g)
    weight = torch.randn(24, 1, kernel, generator=g)
    b = torch.randn(24, generator=g) if bias else None
    run = watch_pass(short_depthwise_conv, lambda x: F.silu(F.conv1d(x, weight, b, groups=24)), x)
    assert run.stats["matches"] == {short_depthwise_conv.PATTERN: 1}
    assert "aten.convolution" not in run.after_names
    torch.testing.assert_close(run.out, run.ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["long", "dense", "padded"])
def test_other_convolutions_are_kept(watch_pass, case):
    x = torch.randn(1, 8, 40)
    weight = torch.randn(8, 1 if case != "dense" else 8, 4)
    groups = 1 if case == "dense" else 8
    padding = 3 if case == "padded" else 0
    run = watch_pass(short_depthwise_conv, lambda x: F.conv1d(x, weight, groups=groups, padding=padding)
                     if case != "long" else F.conv1d(x, weight, groups=groups), x)
    assert run.stats["matches"] == {} and "aten.convolution" in run.after_names

"""conv_channels_last: a depthwise conv1d over a transposed [B, T, C] input gets a channels-last output, so the
per-token ops after the model's transpose back read contiguous rows; numbers equal eager's. Convolutions the
new layout cannot reach (contiguous inputs, one output step, dense weights, other targets) are kept, and a
layout that would change a graph output or break a view downstream is rolled back as a near miss."""
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from npu_graph.pass_api import PassContext
from npu_graph.passes import conv_channels_last
from npu_graph.passes.matching.values import val
from npu_graph.targets.description import describe

CONV = "aten.convolution.default"


def mixer_input(x, weight, proj):
    """Kimi Linear's token mixer input: projection, causal depthwise conv + SiLU, per-head L2 norm."""
    channels, _, taps = weight.shape
    mixed = (x @ proj).transpose(1, 2)
    conv = F.silu(F.conv1d(mixed, weight, padding=taps - 1, groups=channels)[..., :x.shape[1]])
    heads = conv.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1, 16)
    return (heads * torch.rsqrt((heads * heads).sum(-1, keepdim=True) + 1e-6)).sum(-1)


def short_conv_block(weight: torch.Tensor, proj: torch.Tensor):
    return lambda x: mixer_input(x, weight, proj)


def conv_outputs(run_gm):
    return [val(n) for n in run_gm.graph.nodes if n.target == torch.ops.aten.convolution.default]


@pytest.mark.parametrize(("batch", "steps", "channels", "taps"), [(1, 64, 48, 4), (2, 33, 32, 3), (1, 2, 16, 4)])
def test_transposed_input_gets_channels_last_output(watch_pass, batch, steps, channels, taps):
    g = torch.Generator().manual_seed(steps)
    weight, proj = torch.randn(channels, 1, taps, generator=g), torch.randn(24, channels, generator=g)
    x = torch.randn(batch, steps, 24, generator=g)
    run = watch_pass(conv_channels_last, short_conv_block(weight, proj), x)
    assert run.stats["matches"] == {conv_channels_last.PATTERN: 1}
    assert run.after[CONV] == 1 and run.after["aten.as_strided.default"] == run.before["aten.as_strided.default"] + 1
    torch.testing.assert_close(run.out, run.ref, rtol=1e-5, atol=1e-5)


def test_symbolic_lengths(watch_pass):
    weight, proj = torch.randn(32, 1, 4), torch.randn(24, 32)
    block = short_conv_block(weight, proj)
    x = torch.randn(1, 50, 24)
    torch._dynamo.mark_dynamic(x, 1)        # the sequence length symbolic, the weights static (as parameters are)
    run = watch_pass(conv_channels_last, block, x)
    assert run.stats["matches"] == {conv_channels_last.PATTERN: 1}
    torch.testing.assert_close(run.out, run.ref, rtol=1e-5, atol=1e-5)


def test_graph_gives_channels_last_conv_and_contiguous_rows():
    """Run on a traced graph directly: the conv's fake value is channels-last and the transposed-back rows
    are contiguous."""
    args = torch.randn(1, 40, 8), torch.randn(32, 1, 4), torch.randn(8, 32)
    gm = make_fx(mixer_input, tracing_mode="fake")(*args)
    before = conv_outputs(gm)[0].stride()
    result = conv_channels_last.run(gm, PassContext(config=None, machine=describe("cpu")))
    after = conv_outputs(gm)[0].stride()
    assert result.changed and before == (32 * 43, 43, 1) and after == (32 * 43, 1, 32)
    torch.testing.assert_close(gm(*args), mixer_input(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["contiguous input", "one step", "dense weight"])
def test_other_convolutions_are_kept(watch_pass, case):
    x = torch.randn(1, 8, 40) if case == "contiguous input" else torch.randn(1, 40 if case != "one step" else 4,
                                                                             8).transpose(1, 2)
    weight = torch.randn(8, 8 if case == "dense weight" else 1, 4)
    groups = 1 if case == "dense weight" else 8
    run = watch_pass(conv_channels_last, lambda x: F.conv1d(x, weight, groups=groups).sum(1), x,
                     options={"disabled_passes": "short_depthwise_conv"})
    assert run.stats["matches"] == {} and run.after[CONV] == 1
    torch.testing.assert_close(run.out, run.ref, rtol=1e-5, atol=1e-5)


def test_conv_returned_by_the_graph_keeps_its_layout(watch_pass):
    """The caller may view a returned tensor by its strides: a layout change that reaches an output is undone."""
    weight = torch.randn(8, 1, 4)
    x = torch.randn(1, 40, 8).transpose(1, 2)
    run = watch_pass(conv_channels_last, lambda x: F.conv1d(x, weight, groups=8), x)
    assert run.stats["matches"] == {} and "graph output" in run.stats["near_misses"][0]["reason"]
    assert run.out.stride() == run.ref.stride()


def test_view_that_needs_the_old_layout_is_a_near_miss(watch_pass):
    weight = torch.randn(8, 1, 4)
    x = torch.randn(1, 40, 8).transpose(1, 2)
    run = watch_pass(conv_channels_last, lambda x: F.conv1d(x, weight, groups=8).view(-1).cumsum(0), x)
    assert run.stats["matches"] == {} and "propagate" in run.stats["near_misses"][0]["reason"]
    torch.testing.assert_close(run.out, run.ref, rtol=1e-5, atol=1e-5)


def test_npu_target_is_left_alone():
    gm = make_fx(mixer_input, tracing_mode="fake")(torch.randn(1, 40, 8), torch.randn(32, 1, 4), torch.randn(8, 32))
    assert not conv_channels_last.run(gm, PassContext(config=None, machine=describe("npu"))).changed

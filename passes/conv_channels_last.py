"""conv_channels_last: a depthwise 1-D convolution over a channels-last input gives a channels-last output.

Linear-attention layers (KDA, Mamba, GDN) project tokens to [B, T, C] and run their short convolution over the
transposed view [B, C, T] (channel stride 1). aten.convolution returns a contiguous [B, C, T] output, so after
the model transposes it back every per-token op downstream (SiLU, the per-head L2 norm's reduction over 16-128
channels, the gates, the copies into the KDA kernel's layout) reads channels T elements apart. aten picks a
channels-last output when the weight's strides suggest channels-last, and a [C, 1, K] depthwise weight does so
with the stride of its size-1 in-channel dim set to 1: the same memory, the same values. The pass gives the
convolution that view of its weight (`as_strided`, hoisted with the parameters) and re-propagates the graph's
fake values; the model's transpose back then yields a contiguous [B, T, C] (tiny Kimi Linear prefill of 2048
tokens: docs/RESULTS.md, bench e2e).

Targets whose description asks for it (PassContext.machine.channels_last_depthwise_conv: the CPU), inference
graphs, static or symbolic lengths; convolutions with one output step (decode: short_depthwise_conv's) and
inputs that are not channels-last are left alone. When the new layout does not propagate (a view downstream
that only the old strides allow), the graph is restored and the convolution reported as a near miss.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.matching.match_util import near_miss
from npu_graph.passes.matching.meta_refresh import meta_snapshot, refresh_meta
from npu_graph.passes.matching.values import val

NAME = "conv_channels_last"
INFERENCE_ONLY = True
PATTERN = "depthwise conv1d over a channels-last input -> channels-last output"

aten = torch.ops.aten


def _candidate(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target != aten.convolution.default:
        return False
    x, weight, out = val(node.args[0]), val(node.args[1]), val(node)
    if x is None or weight is None or out is None or x.dim() != 3 or node.args[6]:
        return False
    channels = weight.shape[0]
    return (node.args[8] == channels and tuple(weight.shape[1:2]) == (1,) and x.shape[1] == channels
            and statically_known_true(x.stride(1) == 1) and channels > 1 and weight.is_contiguous()
            and statically_known_true(out.shape[2] > 1) and not statically_known_true(out.stride(1) == 1))


def _output_strides(gm: torch.fx.GraphModule) -> list[str]:
    """The strides of the graph's outputs, as text (they may be symbolic): the caller sees them."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat: list[object] = []
    torch.fx.node.map_aggregate(output.args[0], flat.append)
    values = [val(n) for n in flat if isinstance(n, torch.fx.Node)]
    return [str(v.stride()) if isinstance(v, torch.Tensor) else "" for v in values]


def _reads_strides(node: torch.fx.Node) -> bool:
    """Whether an op downstream of the convolution reads its input's strides (as_strided): its values would
    change with the layout."""
    pending, seen = list(node.users), set()
    while pending:
        user = pending.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.target == aten.as_strided.default:
            return True
        pending.extend(user.users)
    return False


def _restore(gm: torch.fx.GraphModule, changed: list[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]]) -> None:
    for node, weight, strided in changed:
        node.update_arg(1, weight)
        gm.graph.erase_node(strided)
    refresh_meta(gm)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    if not ctx.machine.channels_last_depthwise_conv:
        return PassResult(changed=False, stats={"matches": {}})
    graph, changed = gm.graph, []
    outputs_before, before = _output_strides(gm), meta_snapshot(gm)
    for node in [n for n in graph.nodes if _candidate(n) and not _reads_strides(n)]:
        weight = node.args[1]
        channels, _, taps = val(weight).shape
        with graph.inserting_before(node):
            strided = graph.call_function(aten.as_strided.default, (weight, [channels, 1, taps], [taps, 1, 1]))
        node.update_arg(1, strided)
        changed.append((node, weight, strided))
    if not changed:
        return PassResult(changed=False, stats={"matches": {}})
    try:
        refresh_meta(gm, since=before)
        reason = None if _output_strides(gm) == outputs_before else "it would change a graph output's strides"
    except Exception as e:  # a downstream view that only the old strides allow
        reason = f"the channels-last output does not propagate: {type(e).__name__}: {str(e)[:200]}"
    if reason is not None:
        _restore(gm, changed)
        return PassResult(changed=False, stats={"matches": {},
                                                "near_misses": [near_miss(PATTERN, n, reason) for n, _, _ in changed]})
    return PassResult(changed=True, stats={"matches": {PATTERN: len(changed)}})

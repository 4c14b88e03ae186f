"""short_depthwise_conv: a depthwise 1-D convolution with a few output steps -> K shifted multiply-adds.

Linear-attention layers (KDA, Mamba, GDN) run a causal depthwise short convolution (kernel 3-4) over the
cached window at every decode step. oneDNN's convolution costs ~55-70 us for that one-step case on CPU
(192-12288 channels, measured with torch 2.13), while the same math is K multiply-adds over [B, C, T] (~30 us):
out[b, c, t] = Σ_k w[c, 0, k] · x[b, c, t + k] (+ bias[c]); the NPU runs them as plain vector ops too.
Rewritten only for stride 1, no padding, no dilation, groups == channels and a static output length of at most
MAX_STEPS; longer (prefill) convolutions stay convolutions (on CPU the runtime binds them to
kernels/aten/depthwise_conv1d's native kernel, which would also take a one-step call in ~11 us: the pass is kept
because it does not depend on that library being built, and compiled graphs are cached without regard to it).
"""
from __future__ import annotations

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.matching.meta_refresh import meta_snapshot, refresh_meta
from npu_graph.passes.matching.values import val

NAME = "short_depthwise_conv"
INFERENCE_ONLY = False
MAX_STEPS = 16
PATTERN = "depthwise conv1d, <= 16 output steps"

aten = torch.ops.aten


def _is_short_depthwise(node: torch.fx.Node) -> bool:
    if node.target != aten.convolution.default:
        return False
    x, weight, out = val(node.args[0]), val(node.args[1]), val(node)
    stride, padding, dilation, transposed, _, groups = node.args[3:9]
    if x is None or weight is None or out is None or x.dim() != 3 or transposed:
        return False
    channels, steps = weight.shape[0], out.shape[-1]
    return (list(stride), list(padding), list(dilation)) == ([1], [0], [1]) and groups == channels \
        and weight.shape[1] == 1 and x.shape[1] == channels and isinstance(steps, int) and steps <= MAX_STEPS


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    x, weight, bias = node.args[:3]
    kernel, steps = val(weight).shape[-1], val(node).shape[-1]
    with graph.inserting_before(node):
        taps = graph.call_function(aten.squeeze.dim, (weight, 1))
        out = None
        for k in range(kernel):
            window = graph.call_function(aten.slice.Tensor, (x, 2, k, k + steps))
            tap = graph.call_function(aten.unsqueeze.default, (graph.call_function(aten.select.int, (taps, 1, k)),
                                                                -1))
            term = graph.call_function(aten.mul.Tensor, (window, tap))
            out = term if out is None else graph.call_function(aten.add.Tensor, (out, term))
        if bias is not None:
            out = graph.call_function(aten.add.Tensor, (out, graph.call_function(aten.unsqueeze.default,
                                                                                (bias, -1))))
    return out


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    rewritten, before = 0, meta_snapshot(gm)
    for node in list(gm.graph.nodes):
        if _is_short_depthwise(node):
            node.replace_all_uses_with(_rewrite(gm.graph, node))
            gm.graph.erase_node(node)
            rewritten += 1
    if rewritten:
        refresh_meta(gm, since=before)
    return PassResult(changed=bool(rewritten), stats={"matches": {PATTERN: rewritten} if rewritten else {}})

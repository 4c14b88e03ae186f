"""fuse_add_rms_norm: residual add + RMSNorm of the sum -> `ascend_dsa.add_rms_norm`.

Pattern (anchored on the `ascend_dsa.rms_norm` nodes fuse_rms_norm made, which runs first):
    h = x1 + x2;  y, rstd = rms_norm(h, gamma, eps);  h usually used again (the residual stream)
 -> y, rstd, h = add_rms_norm(x1, x2, gamma, eps)
x1 and x2 must both have h's shape and dtype (no broadcast, no alpha). The op adds in the input dtype like
eager `x1 + x2` and normalizes the rounded sum, so the numbers are those of the unfused pair. The fused op
goes right after the add, so that every other user of h can read the op's h; a weight that only exists
later is recreated there when it depends on nothing (the ones of a norm without weight), and otherwise the
candidate is a near miss if h is used before the weight.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.matching.fusion_graph import fuse_matches
from npu_graph.passes.matching.match_util import NoMatch
from npu_graph.passes.matching.values import arg, same_size, val

NAME = "fuse_add_rms_norm"
INFERENCE_ONLY = True
PATTERN = "rms_norm(x1 + x2)"

aten = torch.ops.aten
Node = torch.fx.Node
RMS_NORM = torch.ops.ascend_dsa.rms_norm.default


@dataclass
class AddNormMatch:
    norm: Node
    add: Node
    x1: Node
    x2: Node
    gamma: Node
    eps: float


def _same_type(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.dtype == b.dtype and a.dim() == b.dim() \
        and all(same_size(x, y) for x, y in zip(a.shape, b.shape))


def match(norm: Node) -> AddNormMatch:
    h, gamma = norm.args[0], norm.args[1]
    eps = arg(norm, 2, 1e-6, "epsilon")
    if not isinstance(h, Node) or h.target != aten.add.Tensor or not all(isinstance(a, Node) for a in h.args):
        raise NoMatch("the norm's input is not a sum of two tensors", near=False)
    if h.kwargs.get("alpha", 1) != 1:
        raise NoMatch("the add has alpha != 1")
    if not all(_same_type(val(a), val(h)) for a in h.args):
        raise NoMatch("the add broadcasts or promotes; add_rms_norm adds two tensors of the sum's shape and dtype")
    if not all(u.target is operator.getitem for u in norm.users):
        raise NoMatch("the norm's result is used as a tuple")
    return AddNormMatch(norm, h, h.args[0], h.args[1], gamma, eps)


def _placement(graph: torch.fx.Graph, m: AddNormMatch) -> tuple[Node, Node]:
    """(the node the fused op follows, gamma as available there): right after the add when possible."""
    if m.gamma < m.add:
        return m.add, m.gamma
    if not m.gamma.all_input_nodes:
        with graph.inserting_before(m.add.next):
            gamma = graph.node_copy(m.gamma)
        return gamma, gamma
    if any(u is not m.norm and u < m.gamma for u in m.add.users):
        raise NoMatch("the sum is used before the norm's weight is computed")
    return m.gamma, m.gamma


def rewrite(gm: torch.fx.GraphModule, m: AddNormMatch) -> None:
    graph = gm.graph
    after, gamma = _placement(graph, m)
    with graph.inserting_before(after.next):
        fused = graph.call_function(torch.ops.ascend_dsa.add_rms_norm.default, (m.x1, m.x2, gamma, m.eps))
        outputs = [graph.call_function(operator.getitem, (fused, i)) for i in range(3)]
    for user in list(m.norm.users):
        outputs[user.args[1]].meta["val"] = user.meta["val"]
        user.replace_all_uses_with(outputs[user.args[1]])
    outputs[2].meta["val"] = m.add.meta["val"]  # later matches in this run read it; refresh_meta redoes all
    m.add.replace_all_uses_with(outputs[2], delete_user_cb=lambda user: user is not m.norm)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    return fuse_matches(gm, {RMS_NORM}, match, rewrite, PATTERN)

"""fuse_moe_gating: MoE routing -> `ascend_dsa.moe_gating_top_k`, anchored on the top-k that picks the experts
(logits [T, E]):

    norm  = sigmoid(logits) | softmax(logits, -1)
    score = norm (+ bias[E])                                  the correction bias steers selection only
    [groups] g = view(score, [T, G, E/G]); gs = topk(g, 2).values.sum(-1) | g.amax(-1)
             keep = zeros(T, G).scatter(1, topk(gs, kg).indices, 1); score = masked_fill(score, ~keep, -inf)
    ids = topk(score, k).indices
    w   = norm.gather(1, ids) | topk(norm, k).values  [/ (w.sum(-1, keepdim) (+ eps))]  [* c]
  -> moe_gating_top_k(logits, k, bias, k_group=kg, group_count=G, group_select_mode=1|0, renorm,
                      norm_type=1|0, routed_scaling_factor=c, eps)
The group mask may be applied to the grouped view or to the flat scores (DeepSeek-V3, Kimi, the reference
model); a sigmoid router without renormalisation has no fused form (near miss). The experts the routing feeds
are fused by fuse_moe_experts, which runs first.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.canonical.masks import peel_mask
from npu_graph.passes.canonical.reading import sigmoid_of, softmax_of
from npu_graph.passes.canonical.structure import Structure
from npu_graph.passes.matching.fusion_graph import anchor_text, fuse_matches
from npu_graph.passes.matching.match_util import NoMatch, topk_parts
from npu_graph.passes.matching.values import (
    NEGATIONS,
    RESHAPES,
    VIEWS_AND_CASTS,
    arg,
    is_last_dim,
    is_zero,
    scalar,
    strip,
    strip_casts,
    strip_views,
    val,
)

NAME = "fuse_moe_gating"
INFERENCE_ONLY = True
PATTERN = "topk(norm(logits) + bias, groups) -> normalised weights"

aten = torch.ops.aten
Node = torch.fx.Node


@dataclass
class Gating:
    topk: Node
    logits: Node
    k: int
    norm_type: int
    bias: Node | None = None
    group_count: int = 1
    k_group: int = 1
    group_mode: int = 1
    weights_out: Node | None = None
    renorm: int = 0
    eps: float = 0.0
    scale: float = 1.0


def _norm(node: object) -> tuple[Node, int] | None:
    """(logits, norm_type) for sigmoid(logits) (1) or softmax(logits, -1) (0), in any of their spellings
    (canonical/reading.py)."""
    node = strip_casts(node)
    if not isinstance(node, Node):
        return None
    logits = sigmoid_of(node)
    if logits is not None:
        return logits, 1
    soft = softmax_of(node, Structure(node.graph))
    if soft is not None and is_last_dim(soft[1], node):
        return soft[0], 0
    return None


def _score(node: Node) -> tuple[Node, Node, int, Node | None]:
    """(norm, logits, norm_type, bias) of `norm` or `norm + bias[E]`."""
    found = _norm(node)
    if found is not None:
        return strip_casts(node), *found, None
    if node.target == aten.add.Tensor and all(isinstance(a, Node) for a in node.args[:2]):
        for i in (0, 1):
            found, bias = _norm(node.args[i]), node.args[1 - i]
            experts = val(node).shape[-1]
            if found is not None and val(bias).numel() == experts and val(bias).shape[-1] == experts:
                return strip_casts(node.args[i]), *found, bias
    raise NoMatch("the top-k input is not sigmoid/softmax(logits) (+ a per-expert bias)", near=False)


def _group_scores(gs: Node, score: Node) -> tuple[int, int]:
    """(group_select_mode, group_count) of the per-group scores of `score`."""
    if gs.target == aten.sum.dim_IntList and is_last_dim(gs.args[1][0], gs.args[0]) and len(gs.args[1]) == 1:
        top2 = gs.args[0]
        top = top2.args[0] if top2.target is operator.getitem and top2.args[1] == 0 else None
        if top is not None and top.target == aten.topk.default and top.args[1] == 2 \
                and is_last_dim(arg(top, 2, -1), top.args[0]) and arg(top, 3, True):
            grouped, mode = top2.args[0].args[0], 1
        else:
            raise NoMatch("group scores are not the sum of each group's top-2")
    elif gs.target == aten.amax.default and is_last_dim(gs.args[1][0], gs.args[0]):
        grouped, mode = gs.args[0], 0
    else:
        raise NoMatch("group scores are neither top-2 sums nor maxima")
    shape = val(grouped).shape
    if strip_views(grouped) is not score or len(shape) != 3 or shape[1] * shape[2] != val(score).shape[-1]:
        raise NoMatch("groups are not a [T, G, E/G] view of the selection scores")
    return mode, shape[1]


def _groups(m: Gating, keep_mask: Node, score: Node) -> None:
    """Fill group_count, k_group and group_mode from `keep` = scatter(zeros, 1, topk(gs, kg).indices, 1)."""
    keep = strip_views(keep_mask)
    if keep.target != aten.scatter.value or keep.args[1] not in (1, -1) or scalar(keep.args[3]) != 1:
        raise NoMatch("the group mask is not scatter(zeros, 1, group_idx, 1)")
    if not is_zero(keep.args[0]):
        raise NoMatch("the group mask does not start from zeros")
    idx = keep.args[2]
    if idx.target is not operator.getitem or idx.args[1] != 1 or idx.args[0].target != aten.topk.default:
        raise NoMatch("the kept groups are not a top-k over group scores")
    group_topk = idx.args[0]
    if not isinstance(group_topk.args[1], int) or not is_last_dim(arg(group_topk, 2, -1), group_topk.args[0]):
        raise NoMatch("the group top-k is not over the last dim")
    m.group_mode, m.group_count = _group_scores(group_topk.args[0], score)
    m.k_group = group_topk.args[1]


def _selection(m: Gating) -> Node:
    """Read masks and the score of the expert top-k; returns the norm node."""
    x = strip(m.topk.args[0], RESHAPES)
    masked, mask = peel_mask(x) if x.target in (aten.masked_fill.Scalar, aten.where.self) else (x, None)
    score = strip_views(masked)
    norm, m.logits, m.norm_type, m.bias = _score(score)
    if mask is None:
        return norm
    keep = mask.tensor
    if mask.kind == "invisible":
        keep = _complement(strip_views(keep))
        if keep is None:
            raise NoMatch("the masked experts are not the complement of the kept groups")
    _groups(m, keep, score)
    return norm


def _complement(hidden: Node) -> Node | None:
    """keep when `hidden` is not(keep), or keep == 0 for a 0/1 keep."""
    if hidden.target in NEGATIONS:
        return hidden.args[0]
    if hidden.target == aten.eq.Scalar and is_zero(hidden.args[1]):
        return hidden.args[0]
    return None


def _unsqueezes_last(mask: Node) -> bool:
    """The group mask [T, G] reaches the scores through unsqueeze(-1) (contiguous groups), if at all."""
    node = mask
    while isinstance(node, Node) and node.target in VIEWS_AND_CASTS:
        if node.target == aten.unsqueeze.default and not is_last_dim(node.args[1], node):
            return False
        node = node.args[0]
    return True


def _weights(m: Gating, norm: Node) -> None:
    """Find the routing weights (gathered from the unbiased norm) and their renormalisation and scale."""
    values, ids = topk_parts(m.topk)
    sources = [u for u in ids.users if u.target == aten.gather.default and strip_casts(u.args[0]) is norm
               and u.args[1] in (1, -1) and u.args[2] is ids]
    if values is not None and m.topk.args[0] is norm:
        sources.append(values)
    if len(sources) != 1:
        raise NoMatch("routing weights are not gathered from the unbiased router scores")
    w = sources[0]
    div = next((u for u in w.users if u.target == aten.div.Tensor and u.args[0] is w), None)
    if div is not None:
        eps, total = 0.0, div.args[1]
        if total.target == aten.add.Tensor and scalar(total.args[1]) is not None:
            eps, total = scalar(total.args[1]), total.args[0]
        if total.target == aten.sum.dim_IntList and total.args[0] is w and is_last_dim(total.args[1][0], w) \
                and arg(total, 2, False):
            w, m.renorm, m.eps = div, 1, eps
    scaled = [u for u in w.users if u.target == aten.mul.Tensor and u.args[0] is w and scalar(u.args[1])]
    if len(scaled) == 1 and len(w.users) == 1:
        w, m.scale = scaled[0], scalar(scaled[0].args[1])
    if m.norm_type == 1 and not m.renorm:
        raise NoMatch("sigmoid routing weights without renormalisation (the fused op always renormalises)",
                      differs="w = sigmoid(logits)[top-k] where the pattern has w / Σ_k w")
    m.weights_out = w


def match(topk: Node) -> Gating:
    """The routing read from its top-k; a near miss carries the canonical expression of the scores it selects."""
    try:
        return _match(topk)
    except NoMatch as exc:
        if exc.near and exc.canonical is None:
            scores = anchor_text(topk.args[0])
            exc.canonical = f"top{topk.args[1]}({scores})" if scores else None
        raise


def _match(topk: Node) -> Gating:
    k, dim = topk.args[1], arg(topk, 2, -1)
    x = topk.args[0]
    if not isinstance(k, int) or val(x) is None or val(x).dim() != 2 or not is_last_dim(dim, x) \
            or not arg(topk, 3, True):
        raise NoMatch("not a largest-first top-k over [T, E]", near=False)
    m = Gating(topk, x, k, 0)
    norm = _selection(m)
    if m.group_count > 1 and not _unsqueezes_last(m.topk.args[0]):
        raise NoMatch("the group mask is not broadcast over each group's experts")
    if topk_parts(topk)[1] is None:
        raise NoMatch("the expert indices are unused")
    _weights(m, norm)
    experts = val(x).shape[-1]
    if not isinstance(experts, int) or experts % m.group_count or k > experts // m.group_count * m.k_group:
        raise NoMatch("k exceeds the experts of the kept groups")
    return m


def rewrite(gm: torch.fx.GraphModule, m: Gating) -> None:
    graph = gm.graph
    ids = topk_parts(m.topk)[1]
    bias = m.bias
    with graph.inserting_before(m.topk):
        if bias is not None and val(bias).dim() != 1:
            bias = graph.call_function(aten.reshape.default, (bias, [-1]))
        fused = graph.call_function(
            torch.ops.ascend_dsa.moe_gating_top_k.default, (m.logits, m.k, bias),
            {"k_group": m.k_group, "group_count": m.group_count, "group_select_mode": m.group_mode,
             "renorm": m.renorm, "norm_type": m.norm_type, "routed_scaling_factor": m.scale, "eps": m.eps})
        weights = graph.call_function(operator.getitem, (fused, 0))
        if val(m.weights_out).dtype != val(m.logits).dtype:
            weights = graph.call_function(aten._to_copy.default, (weights,), {"dtype": val(m.weights_out).dtype})
        idx = graph.call_function(operator.getitem, (fused, 1))
        idx = graph.call_function(aten._to_copy.default, (idx,), {"dtype": val(ids).dtype})
    m.weights_out.replace_all_uses_with(weights)
    ids.replace_all_uses_with(idx)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    return fuse_matches(gm, {aten.topk.default}, match, rewrite, PATTERN)

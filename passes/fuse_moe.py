"""fuse_moe: MoE routing -> `ascend_dsa.moe_gating_top_k`, routed SwiGLU experts -> `ascend_dsa.fused_moe`.

The two halves are matched independently.

Gating (anchored on the top-k that picks the experts; logits [T, E]):
    norm  = sigmoid(logits) | softmax(logits, -1)
    score = norm (+ bias[E])                                  the correction bias steers selection only
    [groups] g = view(score, [T, G, E/G]); gs = topk(g, 2).values.sum(-1) | g.amax(-1)
             keep = zeros(T, G).scatter(1, topk(gs, kg).indices, 1); score = masked_fill(score, ~keep, -inf)
    ids = topk(score, k).indices
    w   = norm.gather(1, ids) | topk(norm, k).values  [/ (w.sum(-1, keepdim) (+ eps))]  [* c]
  -> moe_gating_top_k(logits, k, bias, k_group=kg, group_count=G, group_select_mode=1|0, renorm,
                      norm_type=1|0, routed_scaling_factor=c, eps)
  The group mask may be applied to the grouped view or to the flat scores (DeepSeek-V3, Kimi, the
  reference model); a sigmoid router without renormalisation has no fused form (near miss).

Experts (anchored on the combine), x [T, H], weights/ids [T, k]:
- loop: acc = 0; for every expert e: acc = acc + down_e(silu(gate_e(x)) * up_e(x)) * Σ_j w[:, j]·(ids[:, j] == e)
  (the reference model, and per-expert loops as model authors write them);
- grouped: transformers' grouped_mm experts: perm = sort(ids.flatten()), grouped_mm(x[perm // k], w13ᵀ, offs),
  silu(gate) * up, grouped_mm(., w2ᵀ, offs) * w.flatten()[perm], inverse permutation, view(T, k, H).sum(1)
  -> fused_moe(x, w13 [E, 2I, H], w2 [E, H, I], w, ids)
Loop experts keep their weights as separate graph inputs (parameters lifted by Dynamo): the pass stacks them
into w13/w2 inside the graph, which copies every expert's weights on each call; grouped experts are
already stacked.
"""
from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.matching.match_util import NoMatch, near_miss, peel_mask, topk_parts
from npu_graph.passes.matching.meta_refresh import meta_snapshot, refresh_meta
from npu_graph.passes.matching.values import strip_casts, val

NAME = "fuse_moe"
INFERENCE_ONLY = True
PATTERN_GATING = "topk(norm(logits) + bias, groups) -> normalised weights"
PATTERN_LOOP = "Σ_e expert_e(x) · Σ_j w·(ids == e)"
PATTERN_GROUPED = "grouped_mm experts (sorted by expert) -> weighted sum over k"

aten = torch.ops.aten
Node = torch.fx.Node
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.expand.default, aten.clone.default, aten.alias.default}
_GROUPED_MM = ("transformers.grouped_mm_fallback.default", "aten._grouped_mm.default")


def _strip(node: object, ops: set = _VIEWS | {aten._to_copy.default}) -> object:
    while isinstance(node, Node) and node.target in ops:
        node = node.args[0]
    return node


def _scalar(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _last_dim(node: Node, dim: object) -> bool:
    return isinstance(dim, int) and dim % val(node).dim() == val(node).dim() - 1


# ----------------------------------------------------------------------------------------------- gating

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
    """(logits, norm_type) for sigmoid(logits) (1) or softmax(logits, -1) (0)."""
    node = strip_casts(node)
    if not isinstance(node, Node):
        return None
    if node.target == aten.sigmoid.default:
        return node.args[0], 1
    if node.target == aten._softmax.default and _last_dim(node, node.args[1]):
        return node.args[0], 0
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
    if gs.target == aten.sum.dim_IntList and _last_dim(gs.args[0], gs.args[1][0]) and len(gs.args[1]) == 1:
        top2 = gs.args[0]
        top = top2.args[0] if top2.target is operator.getitem and top2.args[1] == 0 else None
        if top is not None and top.target == aten.topk.default and top.args[1] == 2 \
                and _last_dim(top.args[0], _arg(top, 2, -1)) and _arg(top, 3, True):
            grouped, mode = top2.args[0].args[0], 1
        else:
            raise NoMatch("group scores are not the sum of each group's top-2")
    elif gs.target == aten.amax.default and _last_dim(gs.args[0], gs.args[1][0]):
        grouped, mode = gs.args[0], 0
    else:
        raise NoMatch("group scores are neither top-2 sums nor maxima")
    shape = val(grouped).shape
    if _strip(grouped) is not score or len(shape) != 3 or shape[1] * shape[2] != val(score).shape[-1]:
        raise NoMatch("groups are not a [T, G, E/G] view of the selection scores")
    return mode, shape[1]


def _groups(m: Gating, keep_mask: Node, score: Node) -> None:
    """Fill group_count, k_group and group_mode from `keep` = scatter(zeros, 1, topk(gs, kg).indices, 1)."""
    keep = _strip(keep_mask)
    if keep.target != aten.scatter.value or keep.args[1] not in (1, -1) or _scalar(keep.args[3]) != 1:
        raise NoMatch("the group mask is not scatter(zeros, 1, group_idx, 1)")
    if keep.args[0].target not in (aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default):
        raise NoMatch("the group mask does not start from zeros")
    idx = keep.args[2]
    if idx.target is not operator.getitem or idx.args[1] != 1 or idx.args[0].target != aten.topk.default:
        raise NoMatch("the kept groups are not a top-k over group scores")
    group_topk = idx.args[0]
    if not isinstance(group_topk.args[1], int) or not _last_dim(group_topk.args[0], _arg(group_topk, 2, -1)):
        raise NoMatch("the group top-k is not over the last dim")
    m.group_mode, m.group_count = _group_scores(group_topk.args[0], score)
    m.k_group = group_topk.args[1]


def _arg(node: Node, i: int, default: object) -> object:
    return node.args[i] if len(node.args) > i else default


def _selection(m: Gating) -> Node:
    """Read masks and the score of the expert top-k; returns the norm node."""
    x = _strip(m.topk.args[0], {aten.view.default, aten.reshape.default, aten._unsafe_view.default})
    masked, mask = peel_mask(x) if x.target in (aten.masked_fill.Scalar, aten.where.self) else (x, None)
    score = _strip(masked)
    norm, m.logits, m.norm_type, m.bias = _score(score)
    if mask is None:
        return norm
    keep = mask.tensor
    if mask.kind == "invisible":
        keep = _strip(keep)
        if keep.target not in (aten.bitwise_not.default, aten.logical_not.default):
            raise NoMatch("the masked experts are not the complement of the kept groups")
        keep = keep.args[0]
    _groups(m, keep, score)
    return norm


def _unsqueezes_last(mask: Node) -> bool:
    """The group mask [T, G] reaches the scores through unsqueeze(-1) (contiguous groups), if at all."""
    node = mask
    while isinstance(node, Node) and node.target in _VIEWS | {aten._to_copy.default}:
        if node.target == aten.unsqueeze.default and node.args[1] not in (-1, val(node).dim() - 1):
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
        if total.target == aten.add.Tensor and _scalar(total.args[1]) is not None:
            eps, total = _scalar(total.args[1]), total.args[0]
        if total.target == aten.sum.dim_IntList and total.args[0] is w and _last_dim(w, total.args[1][0]) \
                and _arg(total, 2, False):
            w, m.renorm, m.eps = div, 1, eps
    scaled = [u for u in w.users if u.target == aten.mul.Tensor and u.args[0] is w and _scalar(u.args[1])]
    if len(scaled) == 1 and len(w.users) == 1:
        w, m.scale = scaled[0], _scalar(scaled[0].args[1])
    if m.norm_type == 1 and not m.renorm:
        raise NoMatch("sigmoid routing weights without renormalisation (the fused op always renormalises)")
    m.weights_out = w


def match_gating(topk: Node) -> Gating:
    k, dim = topk.args[1], _arg(topk, 2, -1)
    x = topk.args[0]
    if not isinstance(k, int) or val(x) is None or val(x).dim() != 2 or not _last_dim(x, dim) \
            or not _arg(topk, 3, True):
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


def rewrite_gating(gm: torch.fx.GraphModule, m: Gating) -> None:
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


# ---------------------------------------------------------------------------------------------- experts

@dataclass
class Experts:
    pattern: str
    anchor: Node
    x: Node
    weights: Node
    ids: Node
    loop: list[tuple[Node, Node, Node]] | None = None  # (gate, up, down) weights of expert 0, 1, ...
    stacked: tuple[Node, Node] | None = None          # grouped_mm weights [E, H, 2I] and [E, I, H]


@dataclass
class Term:
    x: Node
    gate: Node
    up: Node
    down: Node
    weights: Node
    ids: Node
    expert: int


def _linear(node: object) -> tuple[Node, Node] | None:
    """(input, weight) of input @ weightᵀ written as mm(input, t(weight))."""
    node = _strip(node, {aten.view.default, aten._unsafe_view.default, aten.reshape.default})
    if not isinstance(node, Node) or node.target != aten.mm.default:
        return None
    rhs = node.args[1]
    swapped = rhs.target == aten.transpose.int and rhs.args[1] % 2 != rhs.args[2] % 2
    if (rhs.target == aten.t.default or swapped) and val(rhs.args[0]).dim() == 2:
        return node.args[0], rhs.args[0]
    return None


def _swiglu(node: Node) -> tuple[Node, Node, Node, Node] | None:
    """(x, gate, up, down weights) of down(silu(gate(x)) * up(x))."""
    down = _linear(node)
    act = _strip(down[0], {aten.view.default, aten._unsafe_view.default}) if down else None
    if not isinstance(act, Node) or act.target != aten.mul.Tensor:
        return None
    for silu, up in (act.args, act.args[::-1]):
        silu = _strip(silu, {aten.view.default, aten._unsafe_view.default})
        if isinstance(silu, Node) and silu.target == aten.silu.default:
            gate, up = _linear(silu.args[0]), _linear(up)
            if gate and up and _strip(gate[0]) is _strip(up[0]):
                return gate[0], gate[1], up[1], down[1]
    return None


def _slot_weight(node: Node) -> tuple[Node, Node, int] | None:
    """(weights, ids, e) of Σ_j weights[:, j] · (ids[:, j] == e), as mul or where(ids == e, weights, 0)."""
    total = _strip(node)
    if not isinstance(total, Node) or total.target != aten.sum.dim_IntList or len(total.args[1]) != 1:
        return None
    product = strip_casts(total.args[0])
    if not _last_dim(product, total.args[1][0]):
        return None
    if product.target == aten.mul.Tensor:
        pairs = [(strip_casts(a), b) for a, b in (product.args[:2], product.args[1::-1])]
    elif product.target in (aten.where.self, aten.where.ScalarOther) and _is_zero(product.args[2]):
        pairs = [(product.args[0], product.args[1])]
    else:
        return None
    for eq, weights in pairs:
        if isinstance(eq, Node) and eq.target == aten.eq.Scalar and isinstance(eq.args[1], int):
            return weights, eq.args[0], eq.args[1]
    return None


def _term(node: object) -> Term | None:
    if not isinstance(node, Node) or node.target != aten.mul.Tensor:
        return None
    for out, weight in (node.args[:2], node.args[1::-1]):
        expert, slot = _swiglu(out) if isinstance(out, Node) else None, _slot_weight(weight)
        if expert and slot:
            return Term(*expert, *slot)
    return None


def _chain(anchor: Node) -> tuple[list[Term], Node | None, list[Node]]:
    """Expert terms summed by a chain of adds ending at `anchor`, the chain's start and its add nodes."""
    terms, adds, node = [], [], anchor
    while node.target == aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
        term, acc = _term(node.args[1]), node.args[0]
        if term is None:
            term, acc = _term(node.args[0]), node.args[1]
        if term is None or not isinstance(acc, Node):
            break
        terms.append(term)
        adds.append(node)
        node = acc
    first = _term(node) if terms else None
    if first is not None:
        return [*terms, first], None, adds
    return terms, node, adds


def _is_zero(value: object) -> bool:
    """0, or a node that is all zeros (zeros, zeros_like, full(0), scalar_tensor(0), ...)."""
    if not isinstance(value, Node):
        return _scalar(value) == 0
    if value.target in (aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default):
        return True
    fill = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2,
            aten.scalar_tensor.default: 0}.get(value.target)
    return fill is not None and _scalar(value.args[fill]) == 0


def _expert_count(ids: Node) -> object:
    """How many experts the routed ids can name (the width of the scores they were picked from)."""
    source = strip_casts(ids)
    if source.target is operator.getitem and source.args[1] == 1:
        producer = source.args[0]
        if producer.target in (aten.topk.default, torch.ops.ascend_dsa.moe_gating_top_k.default):
            return val(producer.args[0]).shape[-1]
    return None


def _check_routing(x: Node, weights: Node, ids: Node, experts: int) -> None:
    wv, iv, xv = val(weights), val(ids), val(x)
    if xv is None or xv.dim() != 2 or wv is None or iv is None or wv.dim() != 2 or wv.shape != iv.shape:
        raise NoMatch("tokens are not [T, H] with routing weights and ids [T, k]")
    if not wv.dtype.is_floating_point or iv.dtype not in (torch.int32, torch.int64):
        raise NoMatch("routing weights are not floating point or ids are not int32/int64")
    if _expert_count(ids) != experts:
        raise NoMatch(f"the routed ids are not shown to lie in [0, {experts})")


def match_loop(anchor: Node, terms: list[Term], start: Node | None) -> Experts:
    if start is not None and not _is_zero(start):
        raise NoMatch("the expert sum does not start from zero")
    first = terms[0]
    if sorted(t.expert for t in terms) != list(range(len(terms))):
        raise NoMatch(f"the loop covers experts {sorted(t.expert for t in terms)}, not 0..{len(terms) - 1}")
    for t in terms:
        same = (_strip(t.x) is _strip(first.x), strip_casts(t.weights) is strip_casts(first.weights),
                strip_casts(t.ids) is strip_casts(first.ids))
        if not all(same):
            raise NoMatch("experts read different tokens or routing tensors")
        if any(val(w).dtype != val(first.x).dtype for w in (t.gate, t.up, t.down)):
            raise NoMatch("expert weights and tokens have different dtypes")
    _check_routing(first.x, first.weights, first.ids, len(terms))
    if val(anchor).shape != val(first.x).shape:
        raise NoMatch("the combined output is not [T, H]")
    loop = [(t.gate, t.up, t.down) for t in sorted(terms, key=lambda t: t.expert)]
    return Experts(PATTERN_LOOP, anchor, first.x, first.weights, first.ids, loop=loop)


def _is_grouped_mm(node: object) -> bool:
    return isinstance(node, Node) and str(node.target) in _GROUPED_MM


def _offsets_ok(offs: Node, sort: Node, experts: int) -> bool:
    """offs = cumsum(histc(sorted ids, E, 0, E - 1)): the group boundaries of the sorted ids."""
    if offs.target != aten.cumsum.default:
        return False
    histc = offs.args[0]
    if histc.target != aten.histc.default or tuple(histc.args[1:4]) != (experts, 0, experts - 1):
        return False
    values = strip_casts(histc.args[0])
    return values.target is operator.getitem and values.args[0] is sort and values.args[1] == 0


def _gated(node: Node) -> Node | None:
    """The up-projection `u` of silu(u[:, :I]) * u[:, I:] (a two-way split or chunk of the last dim)."""
    if node.target != aten.mul.Tensor or getattr(node.args[0], "target", None) != aten.silu.default:
        return None
    gate, up = node.args[0].args[0], node.args[1]
    if not (isinstance(up, Node) and gate.target is operator.getitem and up.target is operator.getitem):
        return None
    split = gate.args[0]
    if split is not up.args[0] or (gate.args[1], up.args[1]) != (0, 1):
        return None
    if split.target not in (aten.split.Tensor, aten.split_with_sizes.default) \
            or not _last_dim(split.args[0], _arg(split, 2, 0)):
        return None
    width = val(split.args[0]).shape[-1]
    halves = split.args[1] if split.target == aten.split_with_sizes.default else [split.args[1]] * 2
    return split.args[0] if list(halves) == [width // 2] * 2 and width % 2 == 0 else None


def _sorted_rows(node: Node) -> tuple[Node, Node]:
    """(perm, sort) for rows reordered by perm = sort(ids.flatten()).indices."""
    if node.target != aten.index.Tensor or len(node.args[1]) != 1:
        raise NoMatch("rows are not reordered by an index")
    perm = node.args[1][0]
    if perm.target is not operator.getitem or perm.args[1] != 1 or perm.args[0].target != aten.sort.default:
        raise NoMatch("rows are not reordered by sorted expert ids")
    return perm, perm.args[0]


def _gmm_parts(node: Node) -> tuple[Node, Node, Node]:
    offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    return node.args[0], node.args[1], offs


def _grouped_head(anchor: Node) -> tuple[Node, Node, Node]:
    """(inverse permutation, grouped down projection, per-row weight) of the combine."""
    if anchor.target != aten.sum.dim_IntList or list(anchor.args[1]) != [1] or _arg(anchor, 2, False):
        raise NoMatch("not a sum over the k routed slots", near=False)
    restored = _strip(anchor.args[0], {aten.view.default, aten._unsafe_view.default, aten.reshape.default})
    if not isinstance(restored, Node) or restored.target != aten.index.Tensor or len(restored.args[1]) != 1:
        raise NoMatch("slots are not gathered back from expert order", near=False)
    weighted = restored.args[0]
    if weighted.target != aten.mul.Tensor:
        raise NoMatch("expert rows are not weighted", near=False)
    for down, scale in (weighted.args[:2], weighted.args[1::-1]):
        if _is_grouped_mm(down):
            return restored.args[1][0], down, scale
    raise NoMatch("expert rows do not come from a grouped matmul", near=False)


def match_grouped(anchor: Node) -> Experts:
    inverse, down, scale = _grouped_head(anchor)
    perm, sort = _sorted_rows(_strip(scale))
    if inverse.target != aten.index_put.default or list(inverse.args[1]) != [perm] \
            or inverse.args[2].target != aten.arange.default or _arg(sort, 2, False):
        raise NoMatch("rows are not restored by the inverse of the expert sort")
    act, w2, offs = _gmm_parts(down)
    up = _gated(act)
    if not _is_grouped_mm(up) or _gmm_parts(up)[2] is not offs:
        raise NoMatch("the activation is not silu(gate) * up of a grouped matmul with the same offsets")
    rows, w13, _ = _gmm_parts(up)
    rows = strip_casts(rows)
    ids, weights = _strip(sort.args[0]), _strip(_strip(scale).args[0])
    k = val(ids).shape[-1]
    by_token = rows.args[1][0] if rows.target == aten.index.Tensor and len(rows.args[1]) == 1 else None
    if by_token is None or by_token.target != aten.floor_divide.default or by_token.args[0] is not perm \
            or by_token.args[1] != k:
        raise NoMatch("expert inputs are not the tokens of the sorted slots (x[perm // k])")
    experts, hidden = val(w13).shape[0], val(rows.args[0]).shape[-1]
    if not _offsets_ok(offs, sort, experts) or val(w2).shape[0] != experts:
        raise NoMatch("group offsets are not the histogram of the sorted ids over all experts")
    if tuple(val(w13).shape[1:]) != (hidden, 2 * val(w2).shape[1]) or val(w2).shape[2] != hidden:
        raise NoMatch("expert weights are not [E, H, 2I] and [E, I, H]")
    if tuple(val(anchor.args[0]).shape) != (val(ids).shape[0], k, hidden):
        raise NoMatch("the combine is not a sum over [T, k, H]")
    _check_routing(rows.args[0], weights, ids, experts)
    return Experts(PATTERN_GROUPED, anchor, rows.args[0], weights, ids, stacked=(w13, w2))


def _expert_weights(graph: torch.fx.Graph, m: Experts) -> tuple[Node, Node]:
    """w13 [E, 2I, H] (gate rows first) and w2 [E, H, I]."""
    if m.loop is not None:
        gates, ups, downs = ([w[i] for w in m.loop] for i in range(3))
        w13 = graph.call_function(aten.cat.default, ([graph.call_function(aten.stack.default, (gates,)),
                                                      graph.call_function(aten.stack.default, (ups,))], 1))
        return w13, graph.call_function(aten.stack.default, (downs,))
    out = []
    for w in m.stacked:
        swapped = w.target == aten.transpose.int and {d % 3 for d in w.args[1:]} == {1, 2}
        out.append(w.args[0] if swapped else graph.call_function(aten.transpose.int, (w, 1, 2)))
    return out[0], out[1]


def rewrite_experts(gm: torch.fx.GraphModule, m: Experts) -> None:
    graph = gm.graph
    with graph.inserting_before(m.anchor):
        w13, w2 = _expert_weights(graph, m)
        x, dtype = m.x, val(m.stacked[0] if m.stacked else m.loop[0][0]).dtype
        if val(x).dtype != dtype:
            x = graph.call_function(aten._to_copy.default, (x,), {"dtype": dtype})
        out = graph.call_function(torch.ops.ascend_dsa.fused_moe.default, (x, w13, w2, m.weights, m.ids))
        if val(m.anchor).dtype != dtype:
            out = graph.call_function(aten._to_copy.default, (out,), {"dtype": val(m.anchor).dtype})
    m.anchor.replace_all_uses_with(out)


def _fuse_gating(gm: torch.fx.GraphModule, matches: Counter, near: list) -> None:
    for node in list(gm.graph.nodes):
        if node.target != aten.topk.default:
            continue
        try:
            rewrite_gating(gm, match_gating(node))
            matches[PATTERN_GATING] += 1
        except NoMatch as exc:
            if exc.near:
                near.append(near_miss(PATTERN_GATING, node, str(exc)))


def _fuse_experts(gm: torch.fx.GraphModule, matches: Counter, near: list) -> None:
    seen: set[Node] = set()
    for node in reversed(list(gm.graph.nodes)):
        if node in seen:
            continue
        try:
            if node.target == aten.sum.dim_IntList:
                found = match_grouped(node)
            elif node.target == aten.add.Tensor:
                terms, start, adds = _chain(node)
                seen.update(adds)
                if not terms:
                    continue
                found = match_loop(node, terms, start)
            else:
                continue
            rewrite_experts(gm, found)
            matches[found.pattern] += 1
        except NoMatch as exc:
            if exc.near:
                near.append(near_miss("routed experts", node, str(exc)))


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    matches, near, before = Counter(), [], meta_snapshot(gm)
    _fuse_experts(gm, matches, near)
    _fuse_gating(gm, matches, near)
    if matches:
        gm.graph.eliminate_dead_code()
        refresh_meta(gm, since=before)
    return PassResult(changed=bool(matches), stats={"matches": dict(matches), "near_misses": near})

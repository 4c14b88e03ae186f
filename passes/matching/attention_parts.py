"""The parts of a traced attention, shared by the passes that rewrite MLA-style attention: the softmax and the
value of a P·V matmul, the score with its additive mask split off, and the q·k terms summed in the score."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from npu_graph.passes.matching.axis_trace import Axis, Expr, Tracer, as_leaf, flat, softmax_of
from npu_graph.passes.matching.fusion_graph import leaf_root_ids
from npu_graph.passes.matching.match_util import NoMatch


@dataclass
class Term:
    """One q·k contraction of a score: the two leaves and the contracted axes in k's leaf order."""

    q: torch.fx.Node
    k: torch.fx.Node
    reduced: list[Axis]
    product: torch.fx.Node | None = None   # the node of the q·k product

@dataclass
class SoftmaxParts:
    score: Expr  # the softmax input
    keys: list[Axis]  # the softmax axis
    softmax: torch.fx.Node
    value: Expr  # the P·V matmul's other factor, as a leaf


def softmax_parts(tracer: Tracer, anchor: torch.fx.Node) -> SoftmaxParts:
    """The softmax (`_softmax` or SDPA's `_safe_softmax`) and value of a P·V matmul."""
    expr = tracer.trace(anchor).expr
    if expr.kind != "matmul" or len(expr.factors) != 2:
        raise NoMatch("not a matmul", near=False)
    found = [(i, s) for i, f in enumerate(expr.factors) for s in [softmax_of(tracer, f)] if s is not None]
    reduced = {id(a) for a in flat(list(expr.reduced))}
    if len(found) != 1 or not {id(a) for a in found[0][1][1]} <= reduced:
        raise NoMatch("not softmax(...) @ V over the softmax axis", near=False)
    index, (score, keys, node) = found[0]
    return SoftmaxParts(score, keys, node, as_leaf(tracer, expr.factors[1 - index]))


def has_matmul(expr: Expr) -> bool:
    return expr.kind == "matmul" or any(has_matmul(f) for f in expr.factors)


def split_score_and_mask(score: Expr) -> tuple[Expr, torch.fx.Node | None]:
    """The score expression and, for `score + mask`, the additive mask node."""
    if score.kind == "add" and len(score.factors) == 2 and score.node.target == torch.ops.aten.add.Tensor:
        kinds = [has_matmul(f) for f in score.factors]
        if kinds.count(True) == 1:
            return score.factors[kinds.index(True)], score.node.args[1 - kinds.index(True)]
    return score, None


def score_terms(tracer: Tracer, score: Expr, keys: list[Axis]) -> tuple[list[Term], float]:
    """The q·k contractions summed in the score, and the score's overall scale."""
    scale = 1.0
    while score.kind == "masked":
        scale *= score.scale
        score = score.factors[0]
    if score.kind == "add":
        scale *= score.scale
    parts = list(score.factors) if score.kind == "add" else [score]
    terms, term_scales = [], set()
    for part in parts:
        if part.kind != "matmul" or len(part.factors) != 2:
            raise NoMatch("a score term is not one q·k product")
        a, b = (as_leaf(tracer, f) for f in part.factors)
        key_ids = {id(x) for x in flat(keys)}
        q, k = (b, a) if key_ids <= leaf_root_ids(tracer, a.node) else (a, b)
        if not key_ids <= leaf_root_ids(tracer, k.node):
            raise NoMatch("a score term does not run over the softmax axis")
        reduced = {id(a) for a in flat(list(part.reduced))}
        ordered = [a for d in tracer.leaf_dims[k.node] for a in flat(d) if id(a) in reduced]
        terms.append(Term(q.node, k.node, ordered, part.node))
        term_scales.add(part.scale)
    if len(term_scales) != 1:
        raise NoMatch("score terms carry different scales")
    return terms, scale * term_scales.pop()

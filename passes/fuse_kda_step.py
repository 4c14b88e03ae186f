"""fuse_kda_step: one KDA recurrence step written out in ATen ops (a decode step; fla's fused_recurrent_kda as
model code) -> `ascend_dsa.chunk_kda` over one token.

Pattern, in canonical terms (anchored on the state update; per batch b and head h, S [K, V], k, q, g [K], v [V],
beta a scalar; contractions in any spelling — einsum, matmul, bmm, broadcast multiply + sum — and factors in any
order, passes/canonical/terms.py):
    S' = S·exp(g)  +  k ⊗ (beta · (v − Σ_K k·S·exp(g)))
    o  = Σ_K q'·S'                        q' = q · scale or any query: it goes to the op with scale 1
  -> o, S' = chunk_kda(q'[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], 1.0, S,
                       output_final_state=True)
The step must compute in fp32 (chunk_kda's state is fp32; lower-precision inputs cast to fp32 are read through
their casts, as the step's promotion reads them): other dtypes, operands that do not have the state's
batch and head axes, or a step without its output product are near misses. The op runs the step as the
recurrence does, in fp32, up to rounding order (its native kernel applies the decay lazily).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from itertools import permutations

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.canonical.printer import Printer
from npu_graph.passes.canonical.terms import contraction
from npu_graph.passes.matching.axis_trace import Axis, Expr, TraceError, Tracer, as_leaf, find, flat
from npu_graph.passes.matching.fusion_graph import fuse_each, readers
from npu_graph.passes.matching.match_util import NoMatch
from npu_graph.passes.matching.materialize import materialize
from npu_graph.passes.matching.values import VIEWS_AND_CASTS, strip, val

NAME = "fuse_kda_step"
INFERENCE_ONLY = True
PATTERN = "S' = S·exp(g) + k ⊗ beta(v − k·S·exp(g)); o = q·S'"

aten = torch.ops.aten
Node = torch.fx.Node
MAX_HOPS = 6   # how far after the new state its output product may be (views, a scale)


@dataclass
class Step:
    tracer: Tracer
    new: Node
    out: Node
    leaves: dict[str, Node]          # q, k, v, g, beta, state
    axes: dict[str, Axis]            # b, h, k, v: the state's axes


def _leaf(tracer: Tracer, expr: Expr) -> Node:
    """The node whose value a factor is (its scale included: the factor's node computes it)."""
    return as_leaf(tracer, expr).node


def _decayed(tracer: Tracer, expr: Expr) -> tuple[Node, Node] | None:
    """(S, g) when expr = S · exp(g)."""
    d = contraction(tracer, expr)
    exps = [f for f in d.factors if f.kind == "unary" and f.node.target == aten.exp.default]
    rest = [f for f in d.factors if f not in exps]
    if d.reduced or d.scale != 1.0 or d.scalars or len(exps) != 1 or len(rest) != 1:
        return None
    return _leaf(tracer, rest[0]), _leaf(tracer, exps[0].factors[0])


def _texts(printer: Printer, factors: list[Expr]) -> list[str]:
    """The factors as canonical text, sorted: equal lists are the same product (structural keys)."""
    return sorted(printer.term(f) for f in factors)


def _product_node(tracer: Tracer, near: Node, factors: list[Expr], scale: float = 1.0) -> Node | None:
    """The node that computes scale · Π factors (no reduction) among the few nodes feeding `near`: a key or query
    that is itself a product (an l2-normalised x·rsqrt(Σx²), a scaled query) is one operand of the op."""
    if len(factors) == 1 and scale == 1.0:
        return _leaf(tracer, factors[0])
    printer = Printer(tracer)
    wanted, frontier = _texts(printer, factors), list(near.all_input_nodes)
    for _ in range(MAX_HOPS):
        for node in frontier:
            try:
                c = contraction(tracer, tracer.trace(node).expr)
            except TraceError:
                continue
            if not c.reduced and not c.scalars and c.scale == scale and _texts(printer, c.factors) == wanted:
                tracer.leaf_dims.setdefault(node, tracer.memo[node].dims)     # used as it is, as a leaf
                return node
        frontier = [i for n in frontier for i in n.all_input_nodes]
    return None


def _key_factors(tracer: Tracer, read: Expr, state: Node, g: Node) -> list[Expr] | None:
    """The key's factors when read = −Σ_K k·S·exp(g) (k one factor or a product of several)."""
    c = contraction(tracer, read)
    if c.scale != -1.0 or not c.reduced or c.scalars:
        return None
    states = [f for f in c.factors if f.kind == "leaf" and _leaf(tracer, f) is state]
    decays = [f for f in c.factors if f.kind == "unary" and f.node.target == aten.exp.default
              and _leaf(tracer, f.factors[0]) is g]
    if len(states) != 1 or len(decays) != 1 or len(c.factors) < 3:
        return None
    return [f for f in c.factors if f is not states[0] and f is not decays[0]]


def _correction(tracer: Tracer, expr: Expr, state: Node, g: Node) -> tuple[Node, Node, Node]:
    """(k, beta, v) when expr = k ⊗ beta · (v − Σ_K k · S·exp(g))."""
    o = contraction(tracer, expr)
    diffs = [f for f in o.factors if f.kind == "add" and len(f.factors) == 2]
    if o.reduced or o.scale != 1.0 or o.scalars or len(diffs) != 1 or len(o.factors) < 3:
        raise NoMatch("the state's increment is not k ⊗ beta·(v − k·S)")
    printer, others = Printer(tracer), [f for f in o.factors if f is not diffs[0]]
    for v_expr, read in permutations(diffs[0].factors):
        key = _key_factors(tracer, read, state, g) if v_expr.scale == 1.0 else None
        if key is None:
            continue
        texts, rest = _texts(printer, key), list(others)
        for text in texts:     # the outer product's factors are the key's and beta
            found = next((f for f in rest if printer.term(f) == text), None)
            rest = [f for f in rest if f is not found] if found is not None else None
            if rest is None:
                break
        k = _product_node(tracer, expr.node, key) if rest is not None and len(rest) == 1 else None
        if k is not None:
            return k, _leaf(tracer, rest[0]), _leaf(tracer, v_expr)
    raise NoMatch("the correction is not beta · (v − k·S·exp(g)) with the key of the outer product")


def _update(tracer: Tracer, new: Node) -> dict[str, Node]:
    expr = tracer.trace(new).expr
    if expr.kind != "add" or len(expr.factors) != 2 or any(f.scale != 1.0 for f in expr.factors):
        raise NoMatch("not a KDA state update", near=False)
    for decay, increment in permutations(expr.factors):
        found = _decayed(tracer, decay)
        if found is not None and val(found[0]) is not None and val(found[0]).dim() == 4:
            state, g = found
            try:
                k, beta, v = _correction(tracer, increment, state, g)
            except NoMatch as exc:     # a near miss only where the increment has the delta rule's shape
                raise NoMatch(str(exc), _delta_shaped(tracer, increment)) from exc
            return {"state": state, "g": g, "k": k, "beta": beta, "v": v}
    if any(_delta_shaped(tracer, f) for f in expr.factors):
        raise NoMatch("a delta-rule update of a state without its decay S·exp(g)",
                      differs="S + k ⊗ β(v − k·S) where the pattern has S·exp(g) + k ⊗ β(v − k·S·exp(g))")
    raise NoMatch("not a KDA state update", near=False)


def _delta_shaped(tracer: Tracer, expr: Expr) -> bool:
    """k ⊗ beta·(v − ...): a product of three or more factors (the key may be a product), one of them a difference
    (the rule without its decay)."""
    c = contraction(tracer, expr)
    return not c.reduced and len(c.factors) >= 3 and sum(f.kind == "add" for f in c.factors) == 1


def _output(tracer: Tracer, new: Node, depth: Axis) -> tuple[Node, Node]:
    """(the node computing Σ_K q'·S', q') among the first readers of the new state; q' is the node that computes
    every other factor and the scale (a query that is itself a product, or scaled, is one operand)."""
    for node in readers(new, MAX_HOPS):
        c = contraction(tracer, tracer.trace(node).expr)
        states = [f for f in c.factors if f.node is new]
        if len(states) != 1 or len(c.factors) < 2 or c.reduced_ids() != {id(find(depth))} or c.scalars:
            continue
        q = _product_node(tracer, node, [f for f in c.factors if f is not states[0]], c.scale)
        if q is not None:
            return node, q
    raise NoMatch("the new state is read by 0 output products q·S' (one expected)")


def _axes(tracer: Tracer, state: Node) -> dict[str, Axis | None]:
    """The state's axes by role (None for a dim of size 1)."""
    atoms = [flat(d) for d in tracer.leaf_dims[state]]
    if len(atoms) != 4 or any(len(a) > 1 for a in atoms) or not atoms[2] or not atoms[3]:
        raise NoMatch(f"the state is {tuple(val(state).shape)}; [B, H, K, V] expected")
    return dict(zip("bhkv", (a[0] if a else None for a in atoms)))


def _dims(axes: dict[str, Axis | None], letters: str) -> list[tuple[Axis, ...]]:
    return [(axes[c],) if axes[c] is not None else () for c in letters]


def _check(step: Step) -> None:
    """fp32 arithmetic, and operands over the state's axes only (a broadcast one is expanded)."""
    a = step.axes
    wanted = {"q": "bhk", "k": "bhk", "v": "bhv", "g": "bhk", "beta": "bh"}
    for name, letters in wanted.items():
        node = step.leaves[name]
        have = {id(x) for d in step.tracer.leaf_dims[node] for x in flat(d)}
        allowed = {id(find(a[c])) for c in letters if a[c] is not None}
        if not have <= allowed or (name != "beta" and id(find(a[letters[-1]])) not in have):
            raise NoMatch(f"`{name}` is {tuple(val(node).shape)} (over the state's [{', '.join(letters)}] "
                          f"expected with the state {tuple(val(step.leaves['state']).shape)})")
    for node in (step.new, step.out, step.leaves["state"]):
        if val(node).dtype != torch.float32:
            raise NoMatch(f"the step computes in {val(node).dtype}; chunk_kda's state is float32")


def _insertion_point(graph: torch.fx.Graph, step: Step) -> Node:
    """The first reader of the new state or of the output: the fused step replaces them there, so every operand
    must exist by then."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    first = min([*step.new.users, *step.out.users], key=order.__getitem__)
    late = [n.name for n in step.leaves.values() if order[n] > order[first]]
    if late:
        raise NoMatch(f"{', '.join(late)} computed after the new state is first read")
    return first


def _operand(graph: torch.fx.Graph, step: Step, name: str) -> Node:
    """A leaf laid out as the op takes it ([B, 1, H, ...]), in fp32."""
    a = step.axes
    layout = {"q": "bhk", "k": "bhk", "g": "bhk", "v": "bhv", "beta": "bh"}[name]
    node = step.leaves[name]
    b, *rest = _dims(a, layout)
    out = materialize(graph, node, step.tracer.leaf_dims[node], [b, (), *rest])
    if val(node).dtype != torch.float32:
        out = graph.call_function(aten._to_copy.default, (out,), {"dtype": torch.float32})
    return out


def _replace(gm: torch.fx.GraphModule, step: Step) -> None:
    graph, a = gm.graph, step.axes
    with graph.inserting_before(_insertion_point(graph, step)):
        args = [_operand(graph, step, name) for name in ("q", "k", "v", "g", "beta")]
        fused = graph.call_function(torch.ops.ascend_dsa.chunk_kda.default, (*args, 1.0, step.leaves["state"]),
                                    {"output_final_state": True})
        o = graph.call_function(operator.getitem, (fused, 0))
        new_state = graph.call_function(operator.getitem, (fused, 1))
        b, h, v = _dims(a, "bhv")
        o_dims = [b, (), h, v]
        o_out = materialize(graph, o, o_dims, step.tracer.trace(step.out).dims)
    step.out.replace_all_uses_with(o_out)
    step.new.replace_all_uses_with(new_state)


def _candidate(new: Node) -> bool:
    """A cheap look before tracing: a 4-d add with an exp among the few nodes above it (the decay), or of an input
    (a state a cache holds)."""
    value = val(new)
    if value is None or value.dim() != 4:
        return False
    if any(strip(a, VIEWS_AND_CASTS).op == "placeholder" for a in new.all_input_nodes):
        return True
    frontier = list(new.all_input_nodes)
    for _ in range(4):
        if any(n.target == aten.exp.default for n in frontier):
            return True
        frontier = [i for n in frontier for i in n.all_input_nodes]
    return False


def match(new: Node) -> Step:
    if not _candidate(new):
        raise NoMatch("not a KDA state update", near=False)
    tracer = Tracer()
    try:
        leaves = _update(tracer, new)
        axes = _axes(tracer, leaves["state"])
        out, q = _output(tracer, new, axes["k"])
    except (TraceError, KeyError) as exc:
        raise NoMatch(str(exc), near=False) from exc
    step = Step(tracer, new, out, {**leaves, "q": q}, axes)
    _check(step)
    return step


def _fuse(new: Node, gm: torch.fx.GraphModule) -> str:
    _replace(gm, match(new))
    return PATTERN


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    return fuse_each(gm, {aten.add.Tensor}, lambda node: _fuse(node, gm), PATTERN)

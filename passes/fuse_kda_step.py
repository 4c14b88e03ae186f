"""fuse_kda_step: one KDA recurrence step written out in ATen ops (a decode step; fla's fused_recurrent_kda as
model code) -> `ascend_dsa.chunk_kda` over one token.

Pattern (anchored on the state update; per batch b and head h, S [K, V], k, q, g [K], v [V], beta scalar):
    D     = S * exp(g)[..., None]                              decayed state   [B, H, K, V]
    delta = beta[..., None] * (v - k·D)                        k·D a bmm of views of k and D   [B, H, V]
    S'    = D + k[..., None] * delta[..., None, :]             the new state
    o     = q'·S'                                              a bmm of views of q' and S' (q' = q * scale or
                                                               any query: it goes to the op with scale 1)
  -> o, S' = chunk_kda(q'[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], 1.0, S,
                       output_final_state=True)
The products may come in either operand order; the bmm operands are view chains of k / q' and D / S' (row-major
reshapes, so they flatten (b, h) the same way). Everything must be fp32 (chunk_kda's state is fp32): other
dtypes, shapes that do not line up, or a step without its output product are near misses. The op runs the
step as the recurrence does, in fp32, up to rounding order (its native kernel applies the decay lazily).
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.matching.fusion_graph import fuse_each
from npu_graph.passes.matching.match_util import NoMatch
from npu_graph.passes.matching.values import RESHAPES, UNIT_DIMS, strip, val

NAME = "fuse_kda_step"
INFERENCE_ONLY = True
PATTERN = "S' = S·exp(g) + k ⊗ beta(v − k·S·exp(g)); o = q·S'"

aten = torch.ops.aten
Node = torch.fx.Node
ROW_MAJOR = RESHAPES | UNIT_DIMS


def _shape(node: object) -> tuple[int, ...] | None:
    v = val(node)
    return tuple(v.shape) if v is not None and v.dtype == torch.float32 else None


def _unviewed(node: object) -> object:
    """The tensor a chain of row-major reshapes starts from."""
    return strip(node, ROW_MAJOR)


def _operands(node: object, target: object) -> list[tuple[object, object]]:
    """(a, b) and (b, a) when node is target(a, b), else []."""
    if not isinstance(node, Node) or node.target != target or len(node.args) != 2:
        return []
    a, b = node.args
    return [(a, b), (b, a)]


def _unsqueezed(node: object, dim: int) -> object | None:
    """x when node is unsqueeze(x, dim) (dim counted from the end when negative), else None."""
    if isinstance(node, Node) and node.target == aten.unsqueeze.default:
        x = node.args[0]
        rank = len(_shape(x) or ())
        if node.args[1] % (rank + 1) == dim % (rank + 1):
            return x
    return None


def _decay(node: object) -> tuple[Node, Node] | None:
    """(S, g) when node is S * unsqueeze(exp(g), -1) in either order."""
    for state, factor in _operands(node, aten.mul.Tensor):
        e = _unsqueezed(factor, -1)
        if isinstance(e, Node) and e.target == aten.exp.default and isinstance(state, Node):
            return state, e.args[0]
    return None


def _correction(delta: object, k: Node, decayed: Node) -> tuple[Node, Node, Node]:
    """(v, beta, the bmm k·D) when delta is unsqueeze(beta, -1) * (v - k·decayed)."""
    for b, diff in _operands(delta, aten.mul.Tensor):
        beta = _unsqueezed(b, -1)
        if beta is None or not isinstance(diff, Node) or diff.target != aten.sub.Tensor:
            continue
        v, product = diff.args
        bmm = _unviewed(product)
        if isinstance(bmm, Node) and bmm.target == aten.bmm.default and _unviewed(bmm.args[0]) is k \
                and _unviewed(bmm.args[1]) is decayed:
            return v, beta, bmm
    raise NoMatch("the correction is not beta * (v - k·D) with a bmm of views of k and D")



def _output_product(new_state: Node) -> Node:
    """The bmm reading q'·S' (a view of the new state as its second operand)."""
    found = [user for view in new_state.users if view.target in ROW_MAJOR for user in view.users
             if user.target == aten.bmm.default and user.args[1] is view]
    if len(found) != 1:
        raise NoMatch(f"the new state is read by {len(found)} output products q·S' (one expected)")
    return found[0]


def _check_shapes(q: Node, k: Node, v: Node, g: Node, beta: Node, state: Node, products: tuple[Node, Node]) -> None:
    """fp32 operands of matching sizes, and both bmms over the (b, h) rows flattened alike: [B·H, 1, K] x
    [B·H, K, V] (their operands are row-major reshapes of [B, H, ...] tensors)."""
    b, h, dk, dv = _shape(state) or (None,) * 4
    want = {"q": (q, (b, h, dk)), "k": (k, (b, h, dk)), "g": (g, (b, h, dk)), "v": (v, (b, h, dv)),
            "beta": (beta, (b, h))}
    if dk is not None:
        for i, bmm in enumerate(products):
            want[f"bmm {i + 1}'s query"] = (bmm.args[0], (b * h, 1, dk))
            want[f"bmm {i + 1}'s state"] = (bmm.args[1], (b * h, dk, dv))
    for name, (node, shape) in want.items():
        if _shape(node) != shape or dk is None:
            raise NoMatch(f"`{name}` is {_shape(node)} (fp32 {list(shape)} expected with the state "
                          f"{_shape(state)})")


def _insertion_point(graph: torch.fx.Graph, add: Node, args: tuple[Node, ...]) -> Node:
    """The first reader of the new state: the fused step replaces it there, so every operand must exist by then."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    first = min(add.users, key=order.__getitem__)
    late = [a.name for a in args if order[a] > order[first]]
    if late:
        raise NoMatch(f"{', '.join(late)} computed after the new state is first read")
    return first


def _replace(gm: torch.fx.GraphModule, add: Node, out_bmm: Node, args: tuple[Node, ...], state: Node) -> None:
    graph = gm.graph
    with graph.inserting_before(_insertion_point(graph, add, (*args, state))):
        step = [graph.call_function(aten.unsqueeze.default, (x, 1)) for x in args]
        fused = graph.call_function(torch.ops.ascend_dsa.chunk_kda.default, (*step, 1.0, state),
                                    {"output_final_state": True})
        o = graph.call_function(operator.getitem, (fused, 0))
        new_state = graph.call_function(operator.getitem, (fused, 1))
        o_rows = graph.call_function(aten.view.default, (o, list(val(out_bmm).shape)))
    out_bmm.replace_all_uses_with(o_rows)
    add.replace_all_uses_with(new_state)


def _fuse(add: Node, gm: torch.fx.GraphModule) -> str:
    for decayed, outer in _operands(add, aten.add.Tensor):
        found = _decay(decayed)
        for left, right in _operands(outer, aten.mul.Tensor) if found else []:
            k, delta = _unsqueezed(left, -1), _unsqueezed(right, -2)
            if isinstance(k, Node) and delta is not None:
                state, g = found
                v, beta, state_bmm = _correction(delta, k, decayed)
                out_bmm = _output_product(add)
                q = _unviewed(out_bmm.args[0])
                _check_shapes(q, k, v, g, beta, state, (state_bmm, out_bmm))
                _replace(gm, add, out_bmm, (q, k, v, g, beta), state)
                return PATTERN
    raise NoMatch("not a KDA state update", near=False)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    return fuse_each(gm, {aten.add.Tensor}, lambda node: _fuse(node, gm), PATTERN)

"""fuse_rope: rotary position embeddings written out in ATen ops -> `ascend_dsa.rotary_mul`
(torch_npu.npu_rotary_mul).

Patterns, in canonical terms (one rotation per match; cos and sin broadcast to the rotated values without
enlarging them; sums read as signed terms in any order, products as unordered pairs: passes/matching/rotation.py):
- pairs: out = assemble(x1·c − x2·s, x2·c + x1·s), where assemble is cat([a, b], -1) (halves layout: the
  reference model's indexer, transformers' DeepSeek-V3.2 MLA) or stack([a, b], -1) flattened (pairs layout:
  the reference model's MLA, DeepSeek's reference), and (x1, x2) are the halves or the even / odd values of one
  x (canonical_form writes split / chunk / unbind / select of a pair view as slices), or any two tensors. Becomes
  rotary_mul(assemble(x1, x2), assemble(c, c), assemble(s, s)) in "half" (cat) or "interleave" (stack)
  mode; assemble(x1, x2) is x itself when x1, x2 were taken in the same layout (no node is added).
- rotate_half: out = x·cos + rotate(x)·sin with rotate(x) = assemble(−x2, x1) over the halves (Llama,
  transformers' DeepSeek-V3.2 indexer) or the pairs of x; cos and sin are full width. Becomes
  rotary_mul(x, cos, sin) in the assembly's mode.
- complex: view_as_real(view_as_complex(x as pairs) · polar(1, θ)) (or · a complex tensor): the pairs layout with
  cos θ and sin θ (the op's arithmetic and the complex product's round alike up to an ulp).

rotary_mul takes 4-D tensors of one dtype: lower-rank operands get leading unit dims (and the result
loses them again), operands get cast to the dtype the unfused arithmetic ran in (exact conversions, as
type promotion does). The op's arithmetic equals the unfused form bit for bit. Near misses: a rotation whose
angles broadcast along the rotated dim, that enlarges its input, or has more than 4 dims.
"""
from __future__ import annotations

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.canonical.structure import Structure
from npu_graph.passes.matching.fusion_graph import dim_arg, fuse_each
from npu_graph.passes.matching.match_util import NoMatch
from npu_graph.passes.matching.rotation import Rotation, complex_form, pairs_form, rotate_half_form
from npu_graph.passes.matching.values import RESHAPES, same_size, val

NAME = "fuse_rope"
INFERENCE_ONLY = True
PATTERN_PAIRS = "assemble(x1·cos−x2·sin, x2·cos+x1·sin)"
PATTERN_ROTATE_HALF = "x·cos+rotate(x)·sin"
RANK = 4

aten = torch.ops.aten
Node = torch.fx.Node
INT_MAX = 2 ** 63 - 1


def _same_shape(a: torch.Tensor, shape: list[object]) -> bool:
    return a.dim() == len(shape) and all(same_size(x, y) for x, y in zip(a.shape, shape))


def _check(rot: Rotation) -> torch.dtype:
    """The dtype the rotation computes in, or a near miss saying why the op cannot take it."""
    out = val(rot.x) if rot.out.target == aten.view_as_real.default else val(rot.out)
    half = out.shape[-1] // 2
    width = out.shape[-1] if rot.full_width else half
    for name, angle in (("cos", rot.cos), ("sin", rot.sin)):
        av = val(angle)
        if av is None or av.dim() > out.dim() or not same_size(av.shape[-1], width):
            raise NoMatch(f"{name} broadcasts along the rotated dim (rotary_mul takes one angle per value)")
    operands = [(rot.x, list(out.shape))] if rot.x is not None else \
        [(p, [*out.shape[:-1], half]) for p in rot.parts]
    if not all(_same_shape(val(o), shape) for o, shape in operands):
        raise NoMatch("cos or sin enlarges the rotated tensor (rotary_mul keeps its input's shape)")
    if out.dim() > RANK:
        raise NoMatch(f"the rotation has {out.dim()} dims; rotary_mul takes at most {RANK}")
    if not out.dtype.is_floating_point:
        raise NoMatch(f"the rotation computes in {out.dtype}")
    return out.dtype


def _assemble(graph: torch.fx.Graph, mode: str, a: Node, b: Node) -> Node:
    if mode == "half":
        return graph.call_function(aten.cat.default, ([a, b], -1))
    stacked = graph.call_function(aten.stack.default, ([a, b], -1))
    return graph.call_function(aten.flatten.using_ints, (stacked, -2, -1))


def _operand(graph: torch.fx.Graph, node: Node, like: Node, dtype: torch.dtype) -> Node:
    """node (rank and dtype those of `like`, the tensor it was built from) cast to dtype, with leading unit
    dims up to rank 4."""
    if val(like).dtype != dtype:
        node = graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})
    for _ in range(RANK - val(like).dim()):
        node = graph.call_function(aten.unsqueeze.default, (node, 0))
    return node


def _with_fake_values(nodes: list[Node]) -> None:
    """Give new nodes their fake value (their target run on the fake values of their arguments)."""
    for node in nodes:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        node.meta["val"] = node.target(*args, **kwargs)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(same_size(x, y) for x, y in zip(a.stride(), b.stride()))


def _match_layout(graph: torch.fx.Graph, result: Node, original: torch.Tensor) -> Node:
    """result as laid out like the unfused output (later views were traced on that layout): a contiguous
    copy when the unfused output was contiguous, or a near miss when its layout is another."""
    if _same_layout(val(result), original):
        return result
    if not original.is_contiguous():
        raise NoMatch("the rotation's output layout differs from what rotary_mul returns for its input")
    copy = graph.call_function(aten.clone.default, (result,), {"memory_format": torch.contiguous_format})
    _with_fake_values([copy])
    return copy


def _as_pairs(graph: torch.fx.Graph, result: Node, rank: int) -> Node:
    """result [..., D] viewed as [..., D/2, 2] (what view_as_real of the complex form gives)."""
    shape = [dim_arg(graph, result, i) for i in range(rank - 1)]
    return graph.call_function(aten.view.default, (result, [*shape, -1, 2]))


def rewrite(gm: torch.fx.GraphModule, rot: Rotation, dtype: torch.dtype) -> None:
    graph = gm.graph
    complex_form = rot.out.target == aten.view_as_real.default
    out_rank = val(rot.x if complex_form else rot.out).dim()
    before = set(graph.nodes)
    with graph.inserting_before(rot.out):
        if rot.x is not None:
            x = _operand(graph, rot.x, rot.x, dtype)
        else:
            x = _operand(graph, _assemble(graph, rot.mode, *rot.parts), rot.parts[0], dtype)
        r1, r2 = (_operand(graph, a if rot.full_width else _assemble(graph, rot.mode, a, a), a, dtype)
                  for a in (rot.cos, rot.sin))
        fused = graph.call_function(torch.ops.ascend_dsa.rotary_mul.default, (x, r1, r2), {"rotary_mode": rot.mode})
        result = fused if out_rank == RANK else \
            graph.call_function(aten.squeeze.dims, (fused, list(range(RANK - out_rank))))
        _with_fake_values([n for n in graph.nodes if n not in before])
        if complex_form:
            result = _as_pairs(graph, result, out_rank)
        added = [n for n in graph.nodes if n not in before and "val" not in n.meta]
        _with_fake_values(added)
        try:
            result = _match_layout(graph, result, val(rot.out))
        except NoMatch:
            for node in reversed(added):
                graph.erase_node(node)
            raise
    rot.out.replace_all_uses_with(result)


def _fuse(node: Node, gm: torch.fx.GraphModule, s: Structure) -> str:
    if node.target == aten.add.Tensor:
        rot = rotate_half_form(node, s)
    elif node.target == aten.view_as_real.default:
        rot = complex_form(node, s)
    else:
        rot = pairs_form(node, s)
    rewrite(gm, rot, _check(rot))
    return PATTERN_ROTATE_HALF if rot.full_width else PATTERN_PAIRS


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    s = Structure(gm.graph)
    return fuse_each(gm, {aten.cat.default, *RESHAPES, aten.add.Tensor, aten.view_as_real.default},
                     lambda node: _fuse(node, gm, s), PATTERN_PAIRS)

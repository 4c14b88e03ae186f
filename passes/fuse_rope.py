"""fuse_rope: rotary position embeddings written out in ATen ops -> `ascend_dsa.rotary_mul`
(torch_npu.npu_rotary_mul).

Patterns (one rotation per match; cos and sin broadcast to the rotated values without enlarging them):
- pairs: out = assemble(x1·c − x2·s, x2·c + x1·s), where assemble is cat([a, b], -1) (halves layout: the
  reference model's indexer, transformers' DeepSeek-V3.2 MLA) or stack([a, b], -1) flattened (pairs layout:
  the reference model's MLA, DeepSeek's reference), and (x1, x2) are the halves (split / chunk / slices) or
  the even / odd values (x[..., 0::2], x[..., 1::2]) of one x, or any two tensors. Becomes
  rotary_mul(assemble(x1, x2), assemble(c, c), assemble(s, s)) in "half" (cat) or "interleave" (stack)
  mode; assemble(x1, x2) is x itself when x1, x2 were taken in the same layout (no node is added).
- rotate_half: out = x·cos + rotate(x)·sin with rotate(x) = assemble(−x2, x1) over the halves (Llama,
  transformers' DeepSeek-V3.2 indexer) or the pairs of x; cos and sin are full width. Becomes
  rotary_mul(x, cos, sin) in the assembly's mode.

rotary_mul takes 4-D tensors of one dtype: lower-rank operands get leading unit dims (and the result
loses them again), operands get cast to the dtype the unfused arithmetic ran in (exact conversions, as
type promotion does). The op's arithmetic equals the unfused form bit for bit. Near misses: a rotation whose
angles broadcast along the rotated dim, that enlarges its input, or has more than 4 dims.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from itertools import permutations

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.matching.fusion_graph import fuse_each
from npu_graph.passes.matching.match_util import NoMatch
from npu_graph.passes.matching.values import RESHAPES, arg, is_last_dim, same_size, val

NAME = "fuse_rope"
INFERENCE_ONLY = True
PATTERN_PAIRS = "assemble(x1·cos−x2·sin, x2·cos+x1·sin)"
PATTERN_ROTATE_HALF = "x·cos+rotate(x)·sin"
RANK = 4

aten = torch.ops.aten
Node = torch.fx.Node
INT_MAX = 2 ** 63 - 1


@dataclass
class Rotation:
    """out = assemble(a, b) in `mode` ("half": cat, "interleave": stack + flatten) of the rotated halves."""

    out: Node
    mode: str
    x: Node | None         # the op's input, when the rotated values are one tensor's halves in `mode`
    parts: tuple[Node, Node] | None   # (x1, x2) to assemble otherwise
    cos: Node
    sin: Node
    full_width: bool       # cos/sin already cover all D values (rotate_half form)


def _assembly(node: object) -> tuple[str, Node, Node] | None:
    """(mode, a, b) when node is cat([a, b], -1) ("half") or stack([a, b], -1) merged into the last dim."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    if node.target == aten.cat.default and len(node.args[0]) == 2:
        rank = val(node).dim()
        if is_last_dim(arg(node, 1, 0), rank):
            return "half", *node.args[0]
    stack = _viewed_stack(node)
    if stack is not None:
        sv, nv = val(stack), val(node)
        last = arg(stack, 1, 0)
        if len(stack.args[0]) == 2 and is_last_dim(last, sv.dim()) and nv.dim() == sv.dim() - 1 \
                and all(same_size(a, b) for a, b in zip(nv.shape[:-1], sv.shape[:-2])):
            return "interleave", *stack.args[0]
    return None


def _viewed_stack(node: Node) -> Node | None:
    """The stack node that `node` views through a chain of views used by nothing else (other passes may
    have reshaped the flattened result in steps)."""
    if node.target not in RESHAPES:
        return None
    source = node.args[0]
    while isinstance(source, Node) and source.target in RESHAPES and len(source.users) == 1:
        source = source.args[0]
    return source if isinstance(source, Node) and source.target == aten.stack.default else None


def _slice(node: Node) -> tuple[Node, object, object, object, object] | None:
    """(source, dim, start, end, step) of aten.slice.Tensor with its defaults filled in."""
    if node.target != aten.slice.Tensor:
        return None
    args = list(node.args) + [None] * (5 - len(node.args))
    source, dim, start, end, step = args[:5]
    return source, dim or 0, start or 0, INT_MAX if end is None else end, step or 1


def _halves_source(x1: Node, x2: Node) -> tuple[Node, str] | None:
    """(x, mode) when x1, x2 are x's two halves ("half") or its even and odd values ("interleave")."""
    if x1.target is operator.getitem and x2.target is operator.getitem and x1.args[0] is x2.args[0]:
        split = x1.args[0]
        if split.target in (aten.split.Tensor, aten.split_with_sizes.default) and (x1.args[1], x2.args[1]) == (0, 1) \
                and len(split.users) == 2 and is_last_dim(arg(split, 2, 0), val(split.args[0]).dim()) \
                and same_size(val(x1).shape[-1] * 2, val(split.args[0]).shape[-1]):
            return split.args[0], "half"
    s1, s2 = _slice(x1), _slice(x2)
    if s1 is None or s2 is None or s1[0] is not s2[0] or s1[1] != s2[1]:
        return None
    source = s1[0]
    d = val(source).shape[-1]
    if not is_last_dim(s1[1], val(source).dim()):
        return None
    if s1[4] == s2[4] == 2 and (s1[2], s2[2]) == (0, 1) and s1[3] >= d and s2[3] >= d:
        return source, "interleave"
    half = val(x1).shape[-1]
    if s1[4] == s2[4] == 1 and s1[2] == 0 and same_size(s1[3], half) and same_size(s2[2], half) \
            and s2[3] >= d and same_size(2 * half, d):
        return source, "half"
    return None


def _mul_pairs(node: object) -> list[tuple[Node, Node]]:
    """Both argument orders of a tensor-tensor multiplication, or none."""
    if not isinstance(node, Node) or node.target != aten.mul.Tensor or not all(isinstance(a, Node) for a in node.args):
        return []
    a, b = node.args
    return [(a, b), (b, a)]


def _plain(node: object, target: object) -> bool:
    return isinstance(node, Node) and node.target == target and node.kwargs.get("alpha", 1) == 1 \
        and all(isinstance(a, Node) for a in node.args)


def _rotated_pair(first: Node, second: Node) -> tuple[Node, Node, Node, Node] | None:
    """(x1, x2, c, s) when first = x1·c − x2·s and second = x2·c + x1·s (products in either order)."""
    if not (_plain(first, aten.sub.Tensor) and _plain(second, aten.add.Tensor)):
        return None
    for x1, c in _mul_pairs(first.args[0]):
        for x2, s in _mul_pairs(first.args[1]):
            for m3, m4 in permutations(second.args):
                if any(p == (x2, c) for p in _mul_pairs(m3)) and any(p == (x1, s) for p in _mul_pairs(m4)):
                    return x1, x2, c, s
    return None


def _pairs_form(node: Node) -> Rotation:
    assembled = _assembly(node)
    found = assembled and _rotated_pair(assembled[1], assembled[2])
    if not found:
        raise NoMatch("not a rotation of pairs", near=False)
    x1, x2, c, s = found
    source = _halves_source(x1, x2)
    same_layout = source is not None and source[1] == assembled[0]
    return Rotation(node, assembled[0], source[0] if same_layout else None, None if same_layout else (x1, x2),
                    c, s, full_width=False)


def _rotate_half_form(node: Node) -> Rotation:
    """out = x·cos + assemble(−x2, x1)·sin with (x1, x2) the halves or pairs of x in the assembly's layout."""
    if not _plain(node, aten.add.Tensor):
        raise NoMatch("not a rotation", near=False)
    for first, second in permutations(node.args):
        for x, cos in _mul_pairs(first):
            for rotated, sin in _mul_pairs(second):
                assembled = _assembly(rotated)
                if assembled is None or assembled[1].target != aten.neg.default:
                    continue
                source = _halves_source(assembled[2], assembled[1].args[0])
                if source == (x, assembled[0]):
                    return Rotation(node, assembled[0], x, None, cos, sin, full_width=True)
    raise NoMatch("not a rotation", near=False)


def _same_shape(a: torch.Tensor, shape: list[object]) -> bool:
    return a.dim() == len(shape) and all(same_size(x, y) for x, y in zip(a.shape, shape))


def _check(rot: Rotation) -> torch.dtype:
    """The dtype the rotation computes in, or a near miss saying why the op cannot take it."""
    out = val(rot.out)
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


def rewrite(gm: torch.fx.GraphModule, rot: Rotation, dtype: torch.dtype) -> None:
    graph = gm.graph
    out_rank = val(rot.out).dim()
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
        added = [n for n in graph.nodes if n not in before]
        _with_fake_values(added)
        try:
            result = _match_layout(graph, result, val(rot.out))
        except NoMatch:
            for node in reversed(added):
                graph.erase_node(node)
            raise
    rot.out.replace_all_uses_with(result)


def _fuse(node: Node, gm: torch.fx.GraphModule) -> str:
    rot = _rotate_half_form(node) if node.target == aten.add.Tensor else _pairs_form(node)
    rewrite(gm, rot, _check(rot))
    return PATTERN_ROTATE_HALF if rot.full_width else PATTERN_PAIRS


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    return fuse_each(gm, {aten.cat.default, *RESHAPES, aten.add.Tensor}, lambda node: _fuse(node, gm), PATTERN_PAIRS)

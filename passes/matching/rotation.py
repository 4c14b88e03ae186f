"""Reading a rotary embedding in canonical terms, for fuse_rope. A sum reads as its signed terms (add, sub, neg
and · −1 in any order and association) and each term as the unordered pair of its two factors, so that
x1·c − x2·s, −x2·s + c·x1 and x1·c + (−1·s)·x2 are one reading. The pieces of x come as canonical_form
writes them: halves and even/odd pairs as slices of x's last dim (canonical/reading.py)."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations

import torch
import torch.fx

from npu_graph.passes.canonical.reading import halves, pair_view_source, pairs
from npu_graph.passes.canonical.structure import Structure
from npu_graph.passes.matching.match_util import NoMatch
from npu_graph.passes.matching.values import RESHAPES, arg, is_last_dim, same_size, scalar, val

aten = torch.ops.aten
Node = torch.fx.Node


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


def signed_terms(node: object, sign: int = 1, depth: int = 0) -> list[tuple[int, object]]:
    """The terms of a sum with their signs."""
    if isinstance(node, Node) and depth < 6:
        if node.target in (aten.add.Tensor, aten.sub.Tensor) and node.kwargs.get("alpha", 1) == 1 \
                and all(isinstance(a, Node) for a in node.args[:2]):
            second = -sign if node.target == aten.sub.Tensor else sign
            return signed_terms(node.args[0], sign, depth + 1) + signed_terms(node.args[1], second, depth + 1)
        if node.target == aten.neg.default:
            return signed_terms(node.args[0], -sign, depth + 1)
    return [(sign, node)]


def negated(node: object) -> Node | None:
    """x when `node` is −x (neg, or a product with −1)."""
    if not isinstance(node, Node):
        return None
    if node.target == aten.neg.default:
        return node.args[0]
    if node.target == aten.mul.Tensor and scalar(node.args[1]) == -1:
        return node.args[0]
    return None


def factor_pair(node: object) -> tuple[Node, Node] | None:
    """The two tensor factors of a product (a · −1 scale folded into the sign by the caller)."""
    if isinstance(node, Node) and node.target == aten.mul.Tensor and all(isinstance(a, Node) for a in node.args):
        return node.args[0], node.args[1]
    return None


def _signed_products(node: object) -> list[tuple[int, Node, Node]] | None:
    out = []
    for sign, term in signed_terms(node):
        inner = negated(term)
        if inner is not None:
            sign, term = -sign, inner
        pair = factor_pair(term)
        if pair is None:
            return None
        out.append((sign, *pair))
    return out


def _viewed_stack(node: Node) -> Node | None:
    """The stack node that `node` views through a chain of views used by nothing else."""
    if node.target not in RESHAPES:
        return None
    source = node.args[0]
    while isinstance(source, Node) and source.target in RESHAPES and len(source.users) == 1:
        source = source.args[0]
    return source if isinstance(source, Node) and source.target == aten.stack.default else None


def assembly(node: object) -> tuple[str, Node, Node] | None:
    """(mode, a, b) when node is cat([a, b], -1) ("half") or stack([a, b], -1) merged into the last dim."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    if node.target == aten.cat.default and len(node.args[0]) == 2 and is_last_dim(arg(node, 1, 0), val(node).dim()):
        return "half", *node.args[0]
    stack = _viewed_stack(node)
    if stack is not None:
        sv, nv = val(stack), val(node)
        if len(stack.args[0]) == 2 and is_last_dim(arg(stack, 1, 0), sv.dim()) and nv.dim() == sv.dim() - 1 \
                and all(same_size(a, b) for a, b in zip(nv.shape[:-1], sv.shape[:-2])):
            return "interleave", *stack.args[0]
    return None


def _source(mode: str, x1: Node, x2: Node) -> Node | None:
    return halves(x1, x2) if mode == "half" else pairs(x1, x2)


def _rotated_pair(first: Node, second: Node, s: Structure) -> list[tuple[Node, Node, Node, Node]]:
    """Every (x1, x2, c, s) with first = x1·c − x2·s and second = x2·c + x1·s."""
    a, b = _signed_products(first), _signed_products(second)
    if a is None or b is None or len(a) != 2 or len(b) != 2 or sorted(t[0] for t in a) != [-1, 1] \
            or [t[0] for t in b] != [1, 1]:
        return []
    (_, *plus), (_, *minus) = sorted(a, key=lambda t: -t[0])
    found = []
    for x1, c in permutations(plus):
        for x2, sn in permutations(minus):
            wanted = [(x2, c), (x1, sn)]
            if any(all(_same_pair(p, t[1:], s) for p, t in zip(wanted, order)) for order in permutations(b)):
                found.append((x1, x2, c, sn))
    return found


def _same_pair(p: tuple[Node, Node], q: tuple[Node, Node], s: Structure) -> bool:
    return (s.same(p[0], q[0]) and s.same(p[1], q[1])) or (s.same(p[0], q[1]) and s.same(p[1], q[0]))


def _full_shaped(x1: Node, out: Node) -> bool:
    """x1 spans every dim of the output but the last (the rotated values, not the angles)."""
    xv, ov = val(x1), val(out)
    return xv.dim() == ov.dim() and all(map(same_size, xv.shape[:-1], ov.shape[:-1]))


def pairs_form(node: Node, s: Structure) -> Rotation:
    assembled = assembly(node)
    options = _rotated_pair(assembled[1], assembled[2], s) if assembled else []
    if not options:
        raise _near_rotation(assembled, s)
    mode = assembled[0]
    options.sort(key=lambda o: (_source(mode, o[0], o[1]) is None, not _full_shaped(o[0], node)))
    x1, x2, c, sn = options[0]
    source = _source(mode, x1, x2)
    return Rotation(node, mode, source, None if source is not None else (x1, x2), c, sn, full_width=False)


def _near_rotation(assembled: tuple[str, Node, Node] | None, s: Structure) -> NoMatch:
    """Why an assembly of two sums of two products is not a rotation: a near miss when the four products pair
    four values two by two as a rotation's do (x1·c, x2·s, x2·c, x1·s), else a plain NoMatch."""
    halves_read = [_signed_products(h) for h in assembled[1:]] if assembled else []
    if len(halves_read) != 2 or any(h is None or len(h) != 2 for h in halves_read):
        return NoMatch("not a rotation of pairs", near=False)
    keys = [s.key(f) for h in halves_read for t in h for f in t[1:]]
    if sorted(keys.count(k) for k in set(keys)) != [2, 2, 2, 2]:
        return NoMatch("not a rotation of pairs", near=False)
    signs = ["".join("+" if t[0] > 0 else "−" for t in h) for h in halves_read]
    return NoMatch("the two halves are not x1·c − x2·s and x2·c + x1·s, so this is no rotation",
                   differs=f"signs ({signs[0]}, {signs[1]}) where a rotation has (+−, ++), or other products")


def rotate_half_form(node: Node, s: Structure) -> Rotation:
    """out = x·cos + assemble(−x2, x1)·sin with (x1, x2) the halves or pairs of x in the assembly's layout."""
    terms = _signed_products(node)
    if terms is None or len(terms) != 2 or any(sign != 1 for sign, *_ in terms):
        raise NoMatch("not a rotation", near=False)
    for (_, *first), (_, *second) in permutations(terms):
        for x, cos in permutations(first):
            for rotated, sin in permutations(second):
                assembled = assembly(rotated)
                low = negated(assembled[1]) if assembled else None
                if low is not None and s.same(_source(assembled[0], assembled[2], low), x):
                    return Rotation(node, assembled[0], x, None, cos, sin, full_width=True)
    raise NoMatch("not a rotation", near=False)


def _angles(graph: torch.fx.Graph, f: Node, at: Node) -> tuple[Node, Node] | None:
    """(real, imaginary) nodes of a unit complex factor: cos θ and sin θ of polar(1, θ), or the parts of f."""
    with graph.inserting_before(at):
        if f.target == aten.polar.default:
            radius, angle = f.args
            if radius.target not in (aten.ones_like.default, aten.ones.default):
                return None
            return graph.call_function(aten.cos.default, (angle,)), graph.call_function(aten.sin.default, (angle,))
        parts = graph.call_function(aten.view_as_real.default, (f,))
        return tuple(graph.call_function(aten.select.int, (parts, -1, i)) for i in (0, 1))


def complex_form(node: Node, s: Structure) -> Rotation:
    """view_as_real(view_as_complex(x as [.., D/2, 2]) · f), f = polar(1, θ) or a complex tensor: the even/odd
    pairs of x rotated by f's angles (out is x's shape viewed as [.., D/2, 2])."""
    product = node.args[0] if node.target == aten.view_as_real.default else None
    if not isinstance(product, Node) or product.target != aten.mul.Tensor or len(product.users) != 1:
        raise NoMatch("not a complex rotation", near=False)
    for z, f in permutations(product.args[:2]):
        if getattr(z, "target", None) == aten.view_as_complex.default and isinstance(f, Node) \
                and val(f).dtype.is_complex:
            x = pair_view_source(z.args[0]) or _merged_pairs(z.args[0], node)
            angles = _angles(node.graph, f, node) if x is not None else None
            if angles is None:
                raise NoMatch("a complex product that is not a rotation of x's pairs by unit angles")
            for part in [x, *angles]:
                if "val" not in part.meta:
                    args = torch.fx.node.map_arg(part.args, lambda a: a.meta["val"])
                    part.meta["val"] = part.target(*args)
            return Rotation(node, "interleave", x, None, angles[0], angles[1], full_width=False)
    raise NoMatch("not a complex rotation", near=False)


def _merged_pairs(pairs_view: object, at: Node) -> Node | None:
    """A view [..., D] of a [..., D/2, 2] view whose source has another shape (a projection's [N, H·D])."""
    if not isinstance(pairs_view, Node) or pairs_view.target not in RESHAPES or val(pairs_view).dim() < 2 \
            or not same_size(val(pairs_view).shape[-1], 2):
        return None
    with at.graph.inserting_before(at):
        return at.graph.call_function(aten.view.default, (pairs_view, [*pairs_view.args[1][:-2], -1]))

"""The axis algebra of traced expressions: atomic axes (union-find), dims as tuples of atoms, identifying two
dims (unify_dim: broadcasts take the other side's axes, a static atom meeting several smaller ones is split) and
regrouping atoms after a view (regroup)."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import sympy
import torch

from npu_graph.passes.matching.values import same_size

_ids = itertools.count()


class TraceError(Exception):
    """The subgraph is not an expression the tracer understands; the message says where."""


@dataclass(eq=False)
class Axis:
    """One index of the expression. Axes that a contraction or product identifies are merged
    (union-find): compare axes with `find(a) is find(b)`."""

    size: object
    broadcast: bool = False
    id: int = field(default_factory=lambda: next(_ids))
    parent: Axis | None = None
    source: tuple[torch.fx.Node, int] | None = None
    parts: tuple[Axis, ...] | None = None

    def __repr__(self) -> str:
        return f"{'b' if self.broadcast else 'a'}{find(self).id}[{self.size}]"


def find(axis: Axis) -> Axis:
    while axis.parent is not None:
        axis = axis.parent
    return axis


def flat(dim: Dim | list[Axis]) -> tuple[Axis, ...]:
    """The root atoms of a dim, with refined axes replaced by their parts."""
    out: list[Axis] = []
    for axis in dim:
        root = find(axis)
        out.extend(flat(root.parts) if root.parts else (root,))
    return tuple(out)


Dim = tuple[Axis, ...]


def dim_size(dim: Dim) -> object:
    return math.prod([a.size for a in dim]) if dim else 1


def _split_atom(atom: Axis, first: int) -> tuple[Axis, ...] | None:
    """Refine a static atom into (first, size / first) when `first` divides it: a view that splits a merged dim
    (a projection's output viewed as heads × head dim) splits the atom, and both parts index the same elements."""
    if not isinstance(atom.size, int) or not isinstance(first, int) or first <= 1 or atom.size % first \
            or first >= atom.size:
        return None
    atom.parts = (Axis(first), Axis(atom.size // first))
    return atom.parts


def _ratio(size: object, have: object) -> int | None:
    """size / have when it is a whole number (sizes may be symbolic: 4·s0 / s0 is 4)."""
    if isinstance(size, int) and isinstance(have, int):
        return size // have if have and size % have == 0 else None
    try:
        ratio = _expr(size) / _expr(have)
    except (TypeError, ZeroDivisionError):
        return None
    return int(ratio) if ratio.is_Integer else None


def _expr(size: object) -> object:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


def regroup(dims: list[Dim], shape: list[object]) -> list[Dim]:
    """Dims after a view to `shape`: merges and un-merges atomic axes; a static atom that a view splits is refined
    into parts (_split_atom)."""
    atoms = [a for d in dims for a in flat(d)]
    out, i = [], 0
    for size in shape:
        if same_size(size, 1):
            out.append(())
            continue
        group: list[Axis] = []
        while i < len(atoms) and not same_size(dim_size(tuple(group)), size):
            needed = _ratio(size, dim_size(tuple(group)))
            parts = _split_atom(atoms[i], needed) if needed is not None else None
            if parts is not None:
                atoms[i:i + 1] = list(parts)
            group.append(atoms[i])
            i += 1
        if not same_size(dim_size(tuple(group)), size):
            raise TraceError("view splits an atomic axis")
        out.append(tuple(group))
    if i != len(atoms):
        raise TraceError("view drops axes")
    return out


def _unify_axis(x: Axis, y: Axis) -> Axis:
    rx, ry = find(x), find(y)
    if rx is ry:
        return rx
    if not same_size(rx.size, ry.size):
        raise TraceError("dims of different sizes meet")
    if rx.broadcast and not ry.broadcast:
        rx, ry = ry, rx
    ry.parent = rx
    return rx


def _refine_to_match(fa: tuple[Axis, ...], fb: tuple[Axis, ...]) -> bool:
    """Split the first atom where the two factorizations differ so that they line up (static sizes only)."""
    for x, y in zip(fa, fb):
        if same_size(x.size, y.size):
            continue
        if not (isinstance(x.size, int) and isinstance(y.size, int)):
            return False
        big, rest = (x, fb[fb.index(y):]) if x.size > y.size else (y, fa[fa.index(x):])
        sizes, product = [], 1
        for axis in rest:
            if not isinstance(axis.size, int) or product >= big.size:
                break
            sizes.append(axis.size)
            product *= axis.size
        if product != big.size or (big.source is None and big.parts is None and len(sizes) < 2):
            return False
        big.parts = tuple(Axis(size) for size in sizes)
        return True
    return False


def unify_dim(a: Dim, b: Dim) -> Dim:
    """Two dims that must index the same thing: their axes are identified atom by atom (a broadcast
    dim takes the other side's axes; an atom meeting several smaller ones is split to match them)."""
    if not a or not b:
        return a or b
    fa, fb = flat(a), flat(b)
    if all(x.broadcast for x in fa) and len(fa) != len(fb):
        return b
    if all(x.broadcast for x in fb) and len(fa) != len(fb):
        return a
    while len(fa) != len(fb) or any(not same_size(x.size, y.size) for x, y in zip(fa, fb)):
        if not same_size(dim_size(fa), dim_size(fb)) or not _refine_to_match(fa, fb):
            raise TraceError("dims index different axes")
        fa, fb = flat(a), flat(b)
    return tuple(_unify_axis(x, y) for x, y in zip(fa, fb))

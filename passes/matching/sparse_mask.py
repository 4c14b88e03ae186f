"""Reading a top-k sparse attention mask: which indices select the keys, and what causal mask rides along.

Models turn the indexer's top-k into a dense mask over the keys in three usual ways:
- additive: `full(-inf).scatter(-1, idx, 0)` (+ an additive causal mask);
- boolean (transformers, SDPA path): `where(causal & ~ones.scatter(-1, idx, False), 0, -inf)`, or with
  `zeros.scatter(-1, idx, True)` for the selected keys;
- masked fill (transformers, eager path): `causal_additive.masked_fill(ones.scatter(-1, idx, False), min)`.
`read_sparse_mask` returns the indices and the causal part with its kind (`visible` bool or `additive`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from npu_graph.passes.matching.match_util import NoMatch
from npu_graph.passes.matching.values import NEGATIONS, is_last_dim, is_neg_inf, is_zero, strip_views, val

aten = torch.ops.aten
_AND = {aten.bitwise_and.Tensor, aten.logical_and.default}


@dataclass
class SparseMask:
    indices: torch.fx.Node
    causal: torch.fx.Node | None
    causal_kind: str  # "visible" (bool) | "additive" (float)


def _last_dim_scatter(node: object, fill: object, base_test) -> torch.fx.Node | None:
    """The index node of `base.scatter(-1, idx, fill)` when `base_test(base)` holds."""
    node = strip_views(node)
    if not isinstance(node, torch.fx.Node) or node.target != aten.scatter.value:
        return None
    base, dim, index, value = node.args[:4]
    if not is_last_dim(dim, val(node).dim()) or value != fill or not base_test(base):
        return None
    return index


def _bool_filled(base: object, fill: bool) -> bool:
    if not isinstance(base, torch.fx.Node):
        return False
    if base.target in (aten.new_ones.default, aten.ones.default, aten.ones_like.default):
        return fill
    if base.target in (aten.new_zeros.default, aten.zeros.default, aten.zeros_like.default):
        return not fill
    if base.target in (aten.full.default, aten.new_full.default):
        return base.args[-1] is fill
    return False


def _selected_keys(node: object) -> torch.fx.Node | None:
    """idx when `node` is True exactly at the selected keys (`~ones.scatter(idx, False)` or `zeros.scatter(idx,
    True)`)."""
    node = strip_views(node)
    if isinstance(node, torch.fx.Node) and node.target in NEGATIONS:
        return _last_dim_scatter(node.args[0], False, lambda b: _bool_filled(b, True))
    return _last_dim_scatter(node, True, lambda b: _bool_filled(b, False))


def _read_additive(mask: torch.fx.Node) -> SparseMask:
    parts = [mask] if mask.target != aten.add.Tensor else [strip_views(a) for a in mask.args[:2]]
    found = [(p, i) for p in parts for i in [_last_dim_scatter(p, 0, is_neg_inf)] if i is not None]
    if len(found) != 1:
        raise NoMatch("the mask is not built from top-k indices (scatter of 0 into -inf)", near=False)
    causal = [p for p in parts if p is not found[0][0]]
    if len(causal) > 1:
        raise NoMatch("more than one extra mask")
    return SparseMask(found[0][1], causal[0] if causal else None, "additive")


def _read_where(mask: torch.fx.Node) -> SparseMask:
    cond = strip_views(mask.args[0])
    parts = [cond] if cond.target not in _AND else [strip_views(a) for a in cond.args[:2]]
    found = [(p, i) for p in parts for i in [_selected_keys(p)] if i is not None]
    if len(found) != 1:
        raise NoMatch("the boolean mask does not select top-k indices", near=False)
    causal = [p for p in parts if p is not found[0][0]]
    return SparseMask(found[0][1], causal[0] if causal else None, "visible")


def _read_masked_fill(mask: torch.fx.Node) -> SparseMask:
    index = _last_dim_scatter(mask.args[1], False, lambda b: _bool_filled(b, True))
    if index is None:
        raise NoMatch("the masked_fill does not drop the keys outside the top-k", near=False)
    return SparseMask(index, mask.args[0], "additive")


def read_sparse_mask(additive: torch.fx.Node) -> SparseMask:
    """The top-k indices and causal part of an additive score mask; NoMatch when it is not index-built."""
    mask = strip_views(additive)
    if not isinstance(mask, torch.fx.Node):
        raise NoMatch("the mask is not a tensor", near=False)
    if mask.target == aten.where.self and is_zero(mask.args[1]) and is_neg_inf(mask.args[2]):
        return _read_where(mask)
    if mask.target == aten.masked_fill.Scalar and is_neg_inf(mask.args[2]):
        return _read_masked_fill(mask)
    return _read_additive(mask)


def is_sparse_mask(additive: torch.fx.Node | None) -> bool:
    if additive is None:
        return False
    try:
        read_sparse_mask(additive)
    except NoMatch:
        return False
    return True

"""canonicalize: remove no-op operations, collapse view chains and drop dead code.

Rules (each counted in the pass stats):
- `noop_view`: view/reshape/_unsafe_view/expand/slice to the shape and strides the input already has (a reshape
  of a permuted tensor to its own shape copies it into a contiguous one: not a no-op);
- `view_chain`: view(view(x, a), b) -> view(x, b), also through unsqueeze/squeeze, and
  unsqueeze(view(x, a), d) -> view(x, a with 1 inserted at d); a strict view (not reshape) of a reshape
  collapses only when x is contiguous, since the inner reshape may be the copy that makes the view possible;
- `noop_copy`: clone/_to_copy/alias that changes nothing (same dtype, device, shape) where the copy is
  not needed for aliasing: neither side is a graph input, a graph output or written in place;
- `identity_arith`: x * 1, x / 1, x + 0, x - 0 with the same dtype and shape as x;
- `double_transpose`: t(t(x)) -> x;
- `double_negation`: not(not(x)) -> x for a bool x (bitwise_not and logical_not alike);
- `unit_select`: select(mask, d, 0) of a size-1 dim d of a bool mask -> squeeze(mask, [d]) (the same view: two
  spellings of one attention mask become one node, and CSE leaves one `causal_lengths` for the fused ops reading
  it; other selects stay as the model wrote them, which the fusion patterns read);
- `permute_chain`: permute(permute(x, p), q) -> permute(x, p composed with q); a permute that keeps the order
  of x's non-unit dims and its shape is x itself (`noop_permute`), and a view of such a permute views x
  directly (`unit_permute_view`): moving size-1 dims does not move any element;
- `detached_factory`: x.new_full/new_zeros/new_ones/new_empty(size) -> full/zeros/ones/empty(size) with x's
  dtype and device, so that x is no longer needed (a dense score kept alive only to shape a mask dies);
- `dead_code`: nodes whose results are unused (side-effecting nodes are kept).
Shapes are compared only when they are equal for every value of the symbolic sizes. The fake values of the
nodes a rule changed are recomputed at the end (passes/matching/meta_refresh.py).
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.matching.meta_refresh import meta_snapshot, refresh_meta
from npu_graph.passes.matching.values import CASTS, NEGATIONS, RESHAPES, UNIT_DIMS, negated_bool, same_size, val

NAME = "canonicalize"
INFERENCE_ONLY = False

aten = torch.ops.aten
_FACTORIES = {aten.new_full.default: aten.full.default, aten.new_zeros.default: aten.zeros.default,
              aten.new_ones.default: aten.ones.default, aten.new_empty.default: aten.empty.memory_format}
_IDENTITY = {aten.mul.Tensor: 1, aten.div.Tensor: 1, aten.add.Tensor: 0, aten.sub.Tensor: 0}


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dim() != b.dim():
        return False
    return all(map(same_size, a.shape, b.shape))


def _same_tensor_type(node: torch.fx.Node, source: object) -> bool:
    out, inp = val(node), val(source)
    return (out is not None and inp is not None and out.dtype == inp.dtype
            and out.device == inp.device and _same_shape(out, inp))


def _same_layout(node: torch.fx.Node, source: object) -> bool:
    """Same shape and the same strides along every dim of more than one element."""
    out, inp = val(node), val(source)
    return _same_tensor_type(node, source) and all(
        same_size(size, 1) or same_size(a, b) for size, a, b in zip(out.shape, out.stride(), inp.stride()))


def _contiguous(value: object) -> bool:
    try:
        return isinstance(value, torch.Tensor) and bool(value.is_contiguous())
    except Exception:  # a symbolic layout that cannot be decided without a guard
        return False


def _mutated_or_boundary(node: torch.fx.Node) -> bool:
    if node.op == "placeholder":
        return True
    for user in node.users:
        if user.op == "output":
            return True
        if user.target == aten.copy_.default and user.args[0] is node:
            return True
    return False


def _replacement(node: torch.fx.Node) -> tuple[str, torch.fx.Node] | None:
    """The rule that makes `node` redundant and the node to use instead, if any."""
    target, args = node.target, node.args
    if (target in RESHAPES or target in (aten.expand.default, aten.slice.Tensor)) and _same_layout(node, args[0]):
        return "noop_view", args[0]
    if target in CASTS and _same_tensor_type(node, args[0]) and _plain_copy(node) \
            and not (_mutated_or_boundary(node) or _mutated_or_boundary(args[0])):
        return "noop_copy", args[0]
    if target in _IDENTITY and len(args) == 2 and args[1] == _IDENTITY[target] and not node.kwargs \
            and _same_tensor_type(node, args[0]):
        return "identity_arith", args[0]
    if target == aten.t.default and getattr(args[0], "target", None) == aten.t.default:
        return "double_transpose", args[0].args[0]
    inner = negated_bool(args[0]) if target in NEGATIONS else None
    if inner is not None and _same_tensor_type(node, inner):
        return "double_negation", inner
    return None


def _plain_copy(node: torch.fx.Node) -> bool:
    fmt = node.kwargs.get("memory_format")
    return fmt in (None, torch.preserve_format) and not node.kwargs.get("non_blocking", False)


def _collapse_view_chain(node: torch.fx.Node) -> bool:
    """view(view|unsqueeze|squeeze(x), s) -> view(x, s); unsqueeze(view(x, s), d) -> view(x, s with 1 at d)."""
    source = node.args[0]
    source_target = getattr(source, "target", None)
    if node.target in RESHAPES and (source_target in RESHAPES or source_target in UNIT_DIMS):
        if node.target != aten.reshape.default and source_target == aten.reshape.default \
                and not _contiguous(val(source.args[0])):
            return False
        node.args = (source.args[0], *node.args[1:])
        return True
    if node.target == aten.unsqueeze.default and source_target in RESHAPES and len(source.users) == 1:
        shape = list(source.args[1])
        dim = node.args[1] % (len(shape) + 1)
        with node.graph.inserting_before(node):
            view = node.graph.call_function(source_target, (source.args[0], [*shape[:dim], 1, *shape[dim:]]))
        view.meta = dict(node.meta)
        node.replace_all_uses_with(view)
        return True
    return False


def _unit_dims_only(source: object, perm: list[int]) -> bool:
    """True when permuting `source` by `perm` keeps its non-unit dims in order (only size-1 dims move)."""
    value = val(source)
    if value is None:
        return False
    kept = [d for d in perm if not same_size(value.shape[d], 1)]
    return kept == sorted(kept)


def _collapse_permute(node: torch.fx.Node) -> str | None:
    """permute(permute(x, p), q) -> permute(x, p∘q); view(unit-dim permute(x), s) -> view(x, s)."""
    source = node.args[0]
    if not isinstance(source, torch.fx.Node) or source.target != aten.permute.default:
        return None
    inner = list(source.args[1])
    if node.target == aten.permute.default:
        node.args = (source.args[0], [inner[d % len(inner)] for d in node.args[1]])
        return "permute_chain"
    if node.target in RESHAPES and _unit_dims_only(source.args[0], [d % len(inner) for d in inner]):
        node.args = (source.args[0], *node.args[1:])
        return "unit_permute_view"
    return None


def _noop_permute(node: torch.fx.Node) -> bool:
    if node.target != aten.permute.default or not _same_tensor_type(node, node.args[0]):
        return False
    return _unit_dims_only(node.args[0], [d % len(node.args[1]) for d in node.args[1]])


def _unit_select(node: torch.fx.Node) -> bool:
    """select(x, d, 0 or -1) where the bool x's dim d has size 1 -> squeeze.dims(x, [d])."""
    if node.target != aten.select.int or node.args[2] not in (0, -1):
        return False
    source = val(node.args[0])
    if source is None or source.dtype != torch.bool or not same_size(source.shape[node.args[1]], 1):
        return False
    with node.graph.inserting_before(node):
        squeezed = node.graph.call_function(aten.squeeze.dims, (node.args[0], [node.args[1] % source.dim()]))
    squeezed.meta = dict(node.meta)
    node.replace_all_uses_with(squeezed)
    return True


def _detach_factory(node: torch.fx.Node) -> bool:
    """x.new_full/new_zeros/new_ones/new_empty(size, ...) -> full/zeros/ones/empty(size, dtype, device of x)."""
    factory = _FACTORIES.get(node.target)
    source = val(node.args[0]) if factory is not None else None
    if source is None or any(k not in ("dtype", "device", "layout", "pin_memory") for k in node.kwargs):
        return False
    kwargs = {"dtype": node.kwargs.get("dtype") or source.dtype, "device": node.kwargs.get("device") or source.device,
              "pin_memory": False}
    with node.graph.inserting_before(node):
        fresh = node.graph.call_function(factory, tuple(node.args[1:]), kwargs)
    fresh.meta = dict(node.meta)
    node.replace_all_uses_with(fresh)
    return True


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    counts: Counter[str] = Counter()
    before_meta = meta_snapshot(gm)
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if _collapse_view_chain(node):
            counts["view_chain"] += 1
        collapsed = _collapse_permute(node)
        if collapsed:
            counts[collapsed] += 1
        if _noop_permute(node):
            node.replace_all_uses_with(node.args[0])
            counts["noop_permute"] += 1
            continue
        if _detach_factory(node):
            counts["detached_factory"] += 1
            continue
        if _unit_select(node):
            counts["unit_select"] += 1
            continue
        found = _replacement(node)
        if found is not None:
            rule, source = found
            node.replace_all_uses_with(source)
            counts[rule] += 1
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    counts["dead_code"] += before - len(gm.graph.nodes)
    stats = {rule: n for rule, n in counts.items() if n}
    if stats:
        refresh_meta(gm, since=before_meta)
    return PassResult(changed=bool(stats), stats=stats)

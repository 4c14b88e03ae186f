"""Graph plumbing for the fusion passes: the match-and-rewrite loop (which refreshes node.meta["val"] where a
rewrite changed it, meta_refresh.py), leaf axes, mask and table arguments of the fused ops."""
from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx

from npu_graph.pass_api import PassResult
from npu_graph.passes.canonical.printer import canonical_text
from npu_graph.passes.matching.axis_trace import TraceError, Tracer, flat
from npu_graph.passes.matching.match_util import NoMatch, near_miss
from npu_graph.passes.matching.meta_refresh import meta_snapshot, refresh_meta
from npu_graph.passes.matching.values import negated_bool, same_size, strip_casts, val


def leaf_root_ids(tracer: Tracer, leaf: torch.fx.Node) -> set[int]:
    """ids of the root atoms of a traced leaf (compare axes of different leaves by these)."""
    return {id(a) for d in tracer.leaf_dims[leaf] for a in flat(d)}


def dim_arg(graph: torch.fx.Graph, node: torch.fx.Node, dim: int) -> object:
    """The size of `node`'s dim as a graph argument: an int, or a node reading the symbolic size at run time."""
    size = val(node).shape[dim]
    return size if isinstance(size, int) else graph.call_function(torch.ops.aten.sym_size.int, (node, dim))


def int32_table(graph: torch.fx.Graph, table: torch.fx.Node) -> torch.fx.Node:
    """A block table as the fused ops take it: int32, reading through the model's own casts."""
    table = strip_casts(table)
    if val(table).dtype != torch.int32:
        table = graph.call_function(torch.ops.aten._to_copy.default, (table,), {"dtype": torch.int32})
    return table


def _size(arg: object) -> object:
    """A size argument as a value: an int, the symbolic size a `dim_arg` node reads, else None."""
    if isinstance(arg, torch.fx.Node):
        return val(arg.args[0]).shape[arg.args[1]] if arg.target == torch.ops.aten.sym_size.int else None
    return arg


def _same_sizes(a: list[object], b: list[object]) -> bool:
    """Whether two size lists are known equal (ints, or symbolic sizes equal without a guard)."""
    sizes = [(_size(x), _size(y)) for x, y in zip(a, b)]
    return len(a) == len(b) and all(x is not None and y is not None and same_size(x, y) for x, y in sizes)


def causal_lengths_from_mask(graph: torch.fx.Graph, mask: torch.fx.Node, score_shape: list[object],
                             flat_shape: list[object], kind: str, heads: list[int] | None = None,
                             windows: bool = False) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node | None]:
    """Emit `ascend_dsa.causal_lengths` on a mask (kind: visible / invisible bool, or additive float) broadcast
    to the score (`score_shape`) and laid out as [batch, rows, keys] (`flat_shape`); returns the (query, key)
    length nodes and, with `windows` (the target's fused DSA ops take key starts), the key-start node, else
    None. `heads`: the mask's size-1 dims along attention heads, which the score does not have (a [B, 1, S, K]
    attention mask); other dims the mask has beyond the score's are leading ones of size 1."""
    rank = val(mask).dim()
    drop = sorted(heads or [])[:max(rank - len(score_shape), 0)]
    drop += [d for d in range(rank) if d not in drop][:max(rank - len(drop) - len(score_shape), 0)]
    shape = [size for d, size in enumerate(val(mask).shape) if d not in drop]
    if kind == "invisible":     # a model's negated mask is used as it was before the negation
        mask = negated_bool(mask) or graph.call_function(torch.ops.aten.logical_not.default, (mask,))
    if drop:
        mask = graph.call_function(torch.ops.aten.squeeze.dims, (mask, sorted(drop)))
    if not _same_sizes(shape, score_shape):     # no view to its own shape: two fused ops' masks stay one node
        mask = graph.call_function(torch.ops.aten.expand.default, (mask, score_shape))
    if score_shape is not flat_shape and not _same_sizes(score_shape, flat_shape):
        mask = graph.call_function(torch.ops.aten.reshape.default, (mask, flat_shape))
    lengths = graph.call_function(torch.ops.ascend_dsa.causal_lengths.default, (mask, kind == "additive", windows))
    parts = [graph.call_function(operator.getitem, (lengths, i)) for i in range(3 if windows else 2)]
    return parts[0], parts[1], parts[2] if windows else None


def readers(node: torch.fx.Node, hops: int) -> Iterator[torch.fx.Node]:
    """The calls that read `node` within `hops` steps, nearest first (each once)."""
    frontier, seen = list(node.users), set()
    for _ in range(hops):
        following = []
        for reader in frontier:
            if reader in seen or reader.op != "call_function":
                continue
            seen.add(reader)
            yield reader
            following += reader.users
        frontier = following


def anchor_text(node: torch.fx.Node) -> str | None:
    """The canonical expression at a near miss's anchor (passes/canonical/printer.py), or None where it cannot be
    read."""
    try:
        tracer = Tracer()
        return canonical_text(tracer, tracer.trace(node).expr)
    except Exception:  # a near miss is reported even where its anchor cannot be printed
        return None


def fuse_each(gm: torch.fx.GraphModule, targets: set[object], fuse: Callable[[torch.fx.Node], str],
              label: str, trace_errors_are_near: bool = False, reverse: bool = False) -> PassResult:
    """Try `fuse(node)` on every node whose target is in `targets` (from the graph's end with `reverse`, for a
    pattern anchored on the last node of a chain). `fuse` rewrites and returns the pattern it matched, or
    raises NoMatch (reported as a near miss when it says so) or TraceError."""
    matches: Counter[str] = Counter()
    near = []
    before = meta_snapshot(gm)
    nodes = list(gm.graph.nodes)
    for node in reversed(nodes) if reverse else nodes:
        if node.target not in targets:
            continue
        try:
            matches[fuse(node)] += 1
        except (NoMatch, TraceError) as exc:
            if getattr(exc, "near", trace_errors_are_near):
                canonical = getattr(exc, "canonical", None) or anchor_text(node)
                near.append(near_miss(label, node, str(exc), canonical, getattr(exc, "differs", None)))
    if matches:
        gm.graph.eliminate_dead_code()
        refresh_meta(gm, since=before)
    return PassResult(changed=bool(matches), stats={"matches": dict(matches), "near_misses": near})




def fuse_matches(gm: torch.fx.GraphModule, targets: set[object], match: Callable[[torch.fx.Node], Any],
                 rewrite: Callable[[torch.fx.GraphModule, Any], None], pattern: str,
                 trace_errors_are_near: bool = False) -> PassResult:
    """fuse_each for a pass with one pattern: `rewrite(gm, match(node))` on every candidate node."""
    def fuse(node: torch.fx.Node) -> str:
        rewrite(gm, match(node))
        return pattern

    return fuse_each(gm, targets, fuse, pattern, trace_errors_are_near)

"""canonical_form: rewrite what varies between authors into one form before any fusion pass looks
(docs/DESIGN.md, "The canonical form"; the rules are in passes/canonical/).

One sweep in graph order: each node's rules (rules_elementwise, rules_pieces) replace it with its canonical
spelling, then the operands of a commutative op are put in structural order (canonical/structure.py). A
replacement must keep the node's dtype, shape and strides, or it is dropped; so the values of the nodes that read
it stay right, and only those that may alias it (views) are recomputed, not the whole graph's (a full refresh cost
most of this pass's time). Counted per rule in the stats.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.canonical import rules_elementwise, rules_pieces
from npu_graph.passes.canonical.emit import Emitter
from npu_graph.passes.canonical.structure import Structure, sort_operands
from npu_graph.passes.matching.meta_refresh import refresh_aliases
from npu_graph.passes.matching.values import same_size

NAME = "canonical_form"
INFERENCE_ONLY = False

RULES = {**rules_elementwise.RULES, **rules_pieces.RULES}


def _signature(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.dtype, value.device, tuple(value.shape), tuple(value.stride())
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return type(value)


def _same_value_type(a: object, b: object) -> bool:
    """Same dtype, device, shape and strides (sizes compared without guards), for tensors and tuples of them."""
    sa, sb = _signature(a), _signature(b)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return sa[:2] == sb[:2] and len(sa[2]) == len(sb[2]) and all(map(same_size, sa[2] + sa[3], sb[2] + sb[3]))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_same_value_type, a, b))
    return sa == sb


def _rewrite(node: torch.fx.Node, structure: Structure) -> tuple[str, torch.fx.Node] | None:
    """Apply the first of the node's rules that gives a replacement of the same type; (the rule's name, the
    replacement)."""
    for name, rule in RULES.get(node.target, ()):
        emit = Emitter(node)
        try:
            replacement = rule(node, structure, emit)
        except (TypeError, IndexError, AttributeError, RuntimeError, ValueError):
            replacement = None  # an argument of another form than the rule reads: the rule does not apply
        if replacement is not None and _same_value_type(replacement.meta.get("val"), node.meta.get("val")):
            node.replace_all_uses_with(replacement)
            return name, replacement
        emit.discard()
    return None


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    counts: Counter[str] = Counter()
    structure, replacements = Structure(gm.graph), []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not node.users:
            continue
        rewritten = _rewrite(node, structure)
        if rewritten is not None:
            counts[rewritten[0]] += 1
            replacements.append(rewritten[1])
        elif sort_operands(node, structure):
            counts["operand_order"] += 1
    if counts:
        gm.graph.eliminate_dead_code()
        refresh_aliases(replacements)
    return PassResult(changed=bool(counts), stats=dict(counts))

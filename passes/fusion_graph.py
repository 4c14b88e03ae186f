"""Graph plumbing for the fusion passes: the match-and-rewrite loop, leaf axes, and recomputing
node.meta["val"] after a rewrite so that later passes see correct fake tensors."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from npu_graph.pass_api import PassResult
from npu_graph.passes.axis_trace import Axis, Dim, TraceError, flat
from npu_graph.passes.match_util import NoMatch, near_miss


def leaf_roots(dims: list[Dim]) -> list[Axis]:
    return [a for d in dims for a in flat(d)]


def fuse_each(gm: torch.fx.GraphModule, targets: set[object], fuse: Callable[[torch.fx.Node], str],
              label: str, trace_errors_are_near: bool = False) -> PassResult:
    """Try `fuse(node)` on every node whose target is in `targets`. `fuse` rewrites and returns the pattern
    it matched, or raises NoMatch (reported as a near miss when it says so) or TraceError."""
    matches: Counter[str] = Counter()
    near = []
    for node in list(gm.graph.nodes):
        if node.target not in targets:
            continue
        try:
            matches[fuse(node)] += 1
        except (NoMatch, TraceError) as exc:
            if getattr(exc, "near", trace_errors_are_near):
                near.append(near_miss(label, node, str(exc)))
    if matches:
        gm.graph.eliminate_dead_code()
        refresh_meta(gm)
    return PassResult(changed=bool(matches), stats={"matches": dict(matches), "near_misses": near})


def refresh_meta(gm: torch.fx.GraphModule) -> None:
    """Recompute every node's fake value from the placeholders' (symbolic sizes preserved)."""
    inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = torch._guards.detect_fake_mode([i for i in inputs if isinstance(i, torch.Tensor)])
    gm.recompile()
    FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*inputs)

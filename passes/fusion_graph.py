"""Graph plumbing for the fusion passes: leaf axes, and recomputing
node.meta["val"] after a rewrite so that later passes see correct fake tensors."""
from __future__ import annotations

import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from npu_graph.passes.axis_trace import Axis, Dim, flat


def leaf_roots(dims: list[Dim]) -> list[Axis]:
    return [a for d in dims for a in flat(d)]


def refresh_meta(gm: torch.fx.GraphModule) -> None:
    """Recompute every node's fake value from the placeholders' (symbolic sizes preserved)."""
    inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = torch._guards.detect_fake_mode([i for i in inputs if isinstance(i, torch.Tensor)])
    gm.recompile()
    FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*inputs)

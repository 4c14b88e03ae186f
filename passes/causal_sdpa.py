"""causal_sdpa: CPU flash attention whose mask is a constant causal mask -> the kernel's own `is_causal=True`.

transformers builds its causal (and packed-sequence) masks from aranges; traced, the mask is a constant
subgraph, and `_scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask)` then reads a [L, S] mask
on every call and computes every block, where `is_causal=True` skips the blocks above the diagonal and reads
no mask. The pass evaluates the mask's subgraph at compile time (it reads no graph input, so its value is
the same on every call) and, when it is exactly causal for square attention (bool: true on and below the
diagonal; additive: 0 there and -inf or <= -1e30 above, for every batch and head), drops it for
`is_causal=True`: the same result. Any other mask, a mask that reads inputs, or L != S is left as it is
(a near miss names why).
"""
from __future__ import annotations

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.matching.fusion_graph import fuse_each
from npu_graph.passes.matching.match_util import NoMatch
from npu_graph.passes.matching.values import val

NAME = "causal_sdpa"
INFERENCE_ONLY = True
PATTERN = "flash attention with a constant causal mask -> is_causal"

aten = torch.ops.aten
Node = torch.fx.Node
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
MASKED = -1e30
MAX_EVAL_NODES = 200
MAX_MASK_ELEMENTS = 1 << 26       # [8K, 8K]: larger masks are not built at compile time


def _constant_nodes(mask: Node) -> list[Node]:
    """The mask's subgraph in graph order, or NoMatch when it reads a graph input or is too large to evaluate."""
    seen, stack = set(), [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        if node.op != "call_function" or node.is_impure():
            raise NoMatch(f"the mask reads `{node.name}` ({node.op}): not a constant")
        seen.add(node)
        stack.extend(node.all_input_nodes)
        if len(seen) > MAX_EVAL_NODES:
            raise NoMatch(f"the mask's constant subgraph has more than {MAX_EVAL_NODES} nodes")
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _evaluate(nodes: list[Node]) -> torch.Tensor:
    values: dict[Node, object] = {}
    for node in nodes:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
        values[node] = node.target(*args, **kwargs)
    return values[nodes[-1]]


def _is_causal(mask: torch.Tensor, rows: int, cols: int) -> bool:
    if rows != cols or mask.shape[-2:] != (rows, cols):
        return False
    below = torch.ones(rows, cols, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == below).all())
    return bool(((mask == 0) == below).all() and (mask[..., ~below] <= MASKED).all())


def _rewrite(node: Node) -> str:
    mask = node.kwargs.get("attn_mask")
    if not isinstance(mask, Node):
        raise NoMatch("no mask", near=False)
    q, k = val(node.args[0]), val(node.args[1])
    if len(node.args) > 3 and node.args[3] != 0.0:
        raise NoMatch("dropout")
    rows, cols = q.shape[-2], k.shape[-2]
    if not isinstance(rows, int) or not isinstance(cols, int):
        raise NoMatch("symbolic sequence lengths")
    if val(mask).numel() > MAX_MASK_ELEMENTS:
        raise NoMatch(f"the mask has {val(mask).numel()} values, more than are built at compile time")
    with torch.no_grad(), unset_fake_temporarily():      # passes run under fake tensors: compute real values
        causal = _is_causal(_evaluate(_constant_nodes(mask)), rows, cols)
    if not causal:
        raise NoMatch(f"the constant mask is not causal for {rows} queries x {cols} keys")
    node.args = (*node.args[:3], 0.0, True)
    node.kwargs = {key: v for key, v in node.kwargs.items() if key != "attn_mask"}
    return PATTERN


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    return fuse_each(gm, {FLASH}, _rewrite, PATTERN)

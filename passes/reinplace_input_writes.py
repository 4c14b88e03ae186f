"""reinplace_input_writes: write graph inputs in place instead of copying them whole.

AOT keeps an inference graph functional: `cache.index_put_(...)` in the model becomes
`y = index_put(cache, ...)` followed by `copy_(cache, y)` at the end, which copies the whole KV cache on
every decode step. When nothing reads the old contents of the input after the write (no later user of the
input, nor of a view of it), the write is done in place (`index_put_`, `scatter_`) and the final self-copy
is dropped. Chains of writes (one per cache tensor and layer) are handled write by write.
"""
from __future__ import annotations

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult

NAME = "reinplace_input_writes"
INFERENCE_ONLY = True

aten = torch.ops.aten
INPLACE = {
    aten.index_put.default: aten.index_put_.default,
    aten.scatter.value: aten.scatter_.value,
    aten.scatter.src: aten.scatter_.src,
}
_VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.select.int, aten.slice.Tensor,
             aten.expand.default, aten.permute.default, aten.transpose.int, aten.t.default, aten.alias.default,
             aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.as_strided.default,
             aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.diagonal.default}


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Nodes that read `node`'s storage: its users, and the users of views of it."""
    found = []
    for user in node.users:
        found.append(user)
        if user.target in _VIEW_OPS:
            found += _readers(user)
    return found


def _write_chain(copy: torch.fx.Node) -> list[torch.fx.Node]:
    """The functional writes from the input to the value copied back into it, first write first."""
    target, value = copy.args[0], copy.args[1]
    chain = []
    while isinstance(value, torch.fx.Node) and value.target in INPLACE:
        chain.append(value)
        value = value.args[0]
    return list(reversed(chain)) if value is target else []


def _safe(write: torch.fx.Node, order: dict[torch.fx.Node, int], ignore: torch.fx.Node) -> bool:
    """Nothing reads the written tensor's old contents after `write` runs."""
    return all(order[r] < order[write] for r in _readers(write.args[0]) if r is not write and r is not ignore)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    copies = [n for n in gm.graph.nodes if n.target == aten.copy_.default and n.args[0].op == "placeholder"]
    rewritten, removed = 0, 0
    for copy in copies:
        chain = _write_chain(copy)
        if not chain or not all(_safe(w, order, copy) for w in chain):
            continue
        for write in chain:
            write.target = INPLACE[write.target]
        rewritten += len(chain)
        copy.replace_all_uses_with(copy.args[0])
        gm.graph.erase_node(copy)
        removed += 1
    stats = {"writes_in_place": rewritten, "copies_removed": removed} if removed else {}
    return PassResult(changed=bool(removed), stats=stats)

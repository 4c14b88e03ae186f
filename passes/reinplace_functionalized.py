"""reinplace_functionalized: custom ops that write their arguments run in place, not on copies.

AOT keeps an inference graph functional: a call of an op that writes its arguments (vLLM's `_C.onednn_mm` into
its output buffer, `_C.rotary_embedding` into query and key, `_C.rms_norm` / `_C.silu_and_mul` into `result`)
becomes `auto_functionalized_v2(op, ..., _all_bases=[...])`, which copies every base it writes before the call.
A base needs no copy when nothing reads its old contents afterwards: it is no graph input or constant (nor a view
of one, nor made from parameters and constants alone, which the CPU runtime computes once: runtime.hoist), and
every other reader of its storage (its views, and the results of earlier calls that wrote it in
place) runs before the call. A fresh allocation (`empty`) that several calls write (AOT merges equal `empty`
calls) gets an allocation of its own per call instead: its contents are undefined, so no reader can tell.
The bases that need no copy are left out of the call's `_only_clone_these_bases`, torch's own argument for this
(what Inductor's reinplacing sets); the CPU runtime runs calls that copy nothing without torch's higher-order-op
dispatch (npu_graph.runtime.functionalized). The pass runs after the streams are scheduled, when the node order is
the order a CPU graph runs in (forming SuperKernel regions keeps it); a graph on several streams of a device is
left as it is.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from npu_graph.pass_api import MetaKey, PassContext, PassResult
from npu_graph.passes.streams.deps import root
from npu_graph.runtime.hoist import hoistable

NAME = "reinplace_functionalized"
INFERENCE_ONLY = True

FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized_v2
aten = torch.ops.aten
FRESH = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default, aten.empty_like.default}


def op_results(op: object) -> int:
    """How many items of an auto_functionalized_v2 call's result are the op's own (one for an op that returns
    nothing: its None); the bases follow them."""
    return max(1, len(op._schema.returns))


def _base_source(node: torch.fx.Node, in_place: dict[torch.fx.Node, set[int]]) -> torch.fx.Node | None:
    """The node whose storage `node` is when it is a base that an earlier call wrote in place."""
    if node.target is not operator.getitem or not isinstance(node.args[0], torch.fx.Node):
        return None
    call, index = node.args[0], node.args[1]
    if call not in in_place:
        return None
    base = index - op_results(call.args[0])
    return call.kwargs["_all_bases"][base] if base in in_place[call] else None


def storage_root(node: torch.fx.Node, in_place: dict[torch.fx.Node, set[int]]) -> torch.fx.Node:
    """The node owning `node`'s storage: through views, in-place results and the bases written in place."""
    node = root(node)
    while (source := _base_source(node, in_place)) is not None:
        node = root(source)
    return node


def _aliases(start: torch.fx.Node, in_place: dict[torch.fx.Node, set[int]]) -> set[torch.fx.Node]:
    """Every node whose value is `start`'s storage (views of it, bases written in place, their views)."""
    found, todo = {start}, [start]
    while todo:
        for user in todo.pop().users:
            if user not in found and (root(user) in found or _base_source(user, in_place) in found):
                found.add(user)
                todo.append(user)
    return found


def _no_later_reader(base: torch.fx.Node, call: torch.fx.Node, order: dict[torch.fx.Node, int],
                     in_place: dict[torch.fx.Node, set[int]], once: set[torch.fx.Node]) -> bool:
    """Whether `call` may write `base` in place: its storage is made on every call (not an input, nor computed once:
    `once`), and nothing but `call` reads it after `call` runs."""
    owner = storage_root(base, in_place)
    if owner.op in ("placeholder", "get_attr") or owner in once:
        return False
    aliases = _aliases(owner, in_place)
    readers = {user for node in aliases for user in node.users} - aliases - {call}
    return all(order[reader] < order[call] for reader in readers)


def _own_allocation(graph: torch.fx.Graph, base: torch.fx.Node, call: torch.fx.Node) -> torch.fx.Node:
    """A copy of the allocation `base`, made right before `call`."""
    with graph.inserting_before(call):
        fresh = graph.call_function(base.target, base.args, dict(base.kwargs))
    fresh.meta.update({key: base.meta[key] for key in ("val", "tensor_meta") if key in base.meta})
    return fresh


def _plan_call(graph: torch.fx.Graph, call: torch.fx.Node, order: dict[torch.fx.Node, int],
               in_place: dict[torch.fx.Node, set[int]], once: set[torch.fx.Node]
               ) -> tuple[list[torch.fx.Node], list[int], int]:
    """(the call's bases, those it must still copy, allocations split off) for one auto_functionalized_v2 call."""
    bases, copied, split = list(call.kwargs["_all_bases"]), [], 0
    for i, base in enumerate(bases):
        if not isinstance(base, torch.fx.Node) or _no_later_reader(base, call, order, in_place, once):
            continue
        if base.target in FRESH:
            bases[i] = _own_allocation(graph, base, call)
            order[bases[i]] = order[call]     # just before the call, which is all the check compares with
            split += 1
        else:
            copied.append(i)
    return bases, copied, split


def _out_of_order(gm: torch.fx.GraphModule, ctx: PassContext) -> bool:
    """Whether the graph's work is spread over several device streams (the CPU's run in node order)."""
    device_streams = ctx.machine.stream_device is not None
    return device_streams and any(node.meta.get(MetaKey.STREAM, 0) not in (0, None) for node in gm.graph.nodes)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    calls = [n for n in gm.graph.nodes if n.target is FUNCTIONALIZED and isinstance(n.args[0], torch._ops.OpOverload)
             and not torch._library.utils.is_out(n.args[0]) and "_only_clone_these_bases" not in n.kwargs]
    if not calls or _out_of_order(gm, ctx):
        return PassResult(changed=False)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    once = hoistable(gm, set(ctx.param_indices))
    in_place: dict[torch.fx.Node, set[int]] = {}
    stats = {"calls_in_place": 0, "bases_copied": 0, "allocations_split": 0}
    for call in calls:
        bases, copied, split = _plan_call(gm.graph, call, order, in_place, once)
        call.kwargs = {**call.kwargs, "_all_bases": bases, "_only_clone_these_bases": tuple(copied)}
        in_place[call] = set(range(len(bases))) - set(copied)
        stats["calls_in_place"] += not copied
        stats["bases_copied"] += len(copied)
        stats["allocations_split"] += split
    return PassResult(changed=True, stats=stats)

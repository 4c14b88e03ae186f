"""assign_streams: put independent work on up to `streams.count` streams, with explicit events between them.

What vllm-ascend writes by hand (`npu_stream_switch`, `npu_wait_tensor`) is derived here from the graph: a
cost per node (streams/cost_model.py, the target description's cost profile), the dependencies (data and in-place
writes, streams/deps.py) and list scheduling (streams/schedule.py) give every call_function node its
node.meta["stream"]. The graph is then reordered to launch runs of one stream, and every use of a value
from another stream waits on an event recorded after its producer (npu_graph.runtime.streams.record_event /
wait_event); the graph output waits for every side stream. On CUDA / Ascend graphs, set_stream nodes switch
the launching stream. The plan goes to summary.json `streams`; with one stream the graph is unchanged.
"""
from __future__ import annotations

import torch
import torch.fx

from npu_graph.pass_api import MetaKey, PassContext, PassResult
from npu_graph.passes.streams.cost_model import is_free, node_seconds
from npu_graph.passes.streams.deps import dependencies
from npu_graph.passes.streams.prologs import prolog_plans
from npu_graph.passes.streams.schedule import Slot, program_order, schedule
from npu_graph.runtime.streams import Clocks, record_event, set_stream, stream_of, unordered_uses, wait_event

NAME = "assign_streams"
INFERENCE_ONLY = True


def _reorder(graph: torch.fx.Graph, order: list[torch.fx.Node]) -> None:
    """Put constants after the inputs, then the compute nodes in `order`; the output stays last."""
    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for node in [n for n in graph.nodes if n.op == "get_attr"] + order:
        anchor.append(node)
        anchor = node


def _cross_producers(order: list[torch.fx.Node], deps: dict[torch.fx.Node, list[torch.fx.Node]],
                     plan: dict[torch.fx.Node, Slot]) -> set[torch.fx.Node]:
    """Nodes read on another stream, plus the last node of each side stream (the output joins them)."""
    found = {p for n in order for p in deps[n] if p.op != "get_attr" and stream_of(p) != plan[n].stream}
    last = {plan[n].stream: n for n in order}
    return found | {n for s, n in last.items() if s != 0}


def _insert_events(graph: torch.fx.Graph, order: list[torch.fx.Node],
                   deps: dict[torch.fx.Node, list[torch.fx.Node]], producers: set[torch.fx.Node]) -> int:
    """record_event after every producer read on another stream; wait_event before a consumer for the
    latest producer per stream that it is not yet ordered after. Returns the number of waits."""
    clocks, event_of, waits = Clocks(), {}, 0
    inputs = [n for n in graph.nodes if n.op in ("placeholder", "get_attr")]
    for node in inputs:
        clocks.step(node)

    def record(after: torch.fx.Node, produced: torch.fx.Node) -> None:
        event_of[produced] = len(event_of)
        with graph.inserting_after(after):
            node = graph.call_function(record_event, (event_of[produced], stream_of(produced), produced))
        node.meta[MetaKey.STREAM] = stream_of(produced)
        clocks.step(node)

    for node in inputs:
        if node in producers:
            record(inputs[-1], node)
    for node in [*order, graph.output_node()]:
        s = stream_of(node)
        needs = [n for n in order if stream_of(n) != 0] if node.op == "output" else deps[node]
        latest: dict[int, torch.fx.Node] = {}
        for p in needs:
            if p.op != "get_attr" and not clocks.covers(s, p):
                latest[stream_of(p)] = max(latest.get(stream_of(p), p), p, key=clocks.position.__getitem__)
        for p in latest.values():
            with graph.inserting_before(node):
                wait = graph.call_function(wait_event, (event_of[p], s))
            wait.meta[MetaKey.STREAM] = s
            clocks.step(wait)
            waits += 1
        clocks.step(node)
        if node in producers:
            record(node, node)
    return waits


def _drop_unwaited(graph: torch.fx.Graph) -> int:
    waited = {n.args[0] for n in graph.nodes if n.target is wait_event}
    for node in [n for n in graph.nodes if n.target is record_event and n.args[0] not in waited]:
        graph.erase_node(node)
    return len(waited)


def _insert_switches(graph: torch.fx.Graph, device: str) -> None:
    """set_stream before each change of launching stream, and back to stream 0 before the output."""
    current = 0
    for node in list(graph.nodes):
        wanted = 0 if node.op == "output" else stream_of(node) if node.op == "call_function" else current
        if node.target in (record_event, wait_event) or wanted == current:
            continue
        with graph.inserting_before(node):
            switch = graph.call_function(set_stream, (wanted, device))
        switch.meta[MetaKey.STREAM] = wanted
        current = wanted


def _summary(plan: dict[torch.fx.Node, Slot], cost: dict[torch.fx.Node, float], count: int, profile_name: str,
             events: int, prologs: list[dict]) -> dict:
    us = 1e6
    return {"count": count, "used": len({s.stream for s in plan.values()}), "profile": profile_name,
            "makespan_serial": round(sum(cost.values()) * us, 3),
            "makespan": round(max((s.end for s in plan.values()), default=0.0) * us, 3),
            "events": events, "prologs": prologs,
            "nodes": {n.name: {"stream": s.stream, "start": round(s.start * us, 3), "end": round(s.end * us, 3)}
                      for n, s in plan.items()}}


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    count = ctx.config.streams.count
    profile = ctx.machine.cost
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    deps = dependencies(gm.graph)
    cost = {n: node_seconds(n, profile) for n in nodes}
    plan = schedule(nodes, deps, cost, {n for n in nodes if is_free(n)}, count, profile.event_s)
    for node in nodes:
        node.meta[MetaKey.STREAM] = plan[node].stream
    prologs = prolog_plans(nodes, deps, cost, count, profile.event_s)
    used = len({s.stream for s in plan.values()})
    events = 0
    if used > 1:
        order = program_order(nodes, deps, plan)
        _reorder(gm.graph, order)
        _insert_events(gm.graph, order, deps, _cross_producers(order, deps, plan))
        events = _drop_unwaited(gm.graph)
        if ctx.machine.stream_device is not None:
            _insert_switches(gm.graph, ctx.machine.stream_device)
        races = unordered_uses(gm.graph, dependencies(gm.graph))
        if races:
            raise RuntimeError(f"stream plan has unordered uses: {races[:3]}")
    summary = _summary(plan, cost, count, profile.name, events, prologs)
    stats = {k: summary[k] for k in ("used", "makespan_serial", "makespan", "events")}
    return PassResult(changed=used > 1, stats=stats, summary={"streams": summary})

"""The lightning indexer's prolog: its modeled time on several streams, against running it serially.

The prolog of an indexer is the work only one of its input branches needs: walk back from each input
(through views and tuple access to the op that computes it) and keep the nodes that are ancestors of exactly
one branch. What the branches share (the layer input, RoPE tables, earlier layers) is not prolog.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.fx

from npu_graph.passes.streams.cost_model import is_free
from npu_graph.passes.streams.schedule import schedule


def _computing(node: torch.fx.Node) -> torch.fx.Node:
    """The op that computes `node`'s value: `node` itself, or the source of a chain of views."""
    while node.op == "call_function" and is_free(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _ancestors(node: torch.fx.Node, deps: dict[torch.fx.Node, list[torch.fx.Node]]) -> set[torch.fx.Node]:
    found, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in found or current not in deps:
            continue
        found.add(current)
        stack.extend(deps[current])
    return found


def prolog(indexer: torch.fx.Node, deps: dict[torch.fx.Node, list[torch.fx.Node]]) -> set[torch.fx.Node]:
    heads = dict.fromkeys(_computing(p) for p in deps[indexer])
    counts = Counter(n for head in heads for n in _ancestors(head, deps))
    return {n for n, c in counts.items() if c == 1}


def prolog_plans(nodes: list[torch.fx.Node], deps: dict[torch.fx.Node, list[torch.fx.Node]],
                 cost: dict[torch.fx.Node, float], count: int, event_s: float) -> list[dict]:
    """Per lightning_indexer: its prolog scheduled on its own onto `count` streams: serial and modeled
    time (us), and which nodes of the prolog went to which stream."""
    plans = []
    for node in nodes:
        if getattr(node.target, "_opname", "") != "lightning_indexer":
            continue
        members = prolog(node, deps)
        work = [n for n in nodes if n in members]
        if not any(cost[n] > 0 for n in work):
            continue
        local = {n: [p for p in deps[n] if p in members] for n in work}
        plan = schedule(work, local, cost, {n for n in work if cost[n] == 0}, count, event_s)
        busy = [n for n in work if cost[n] > 0]
        plans.append({"indexer": node.name, "nodes": len(busy), "serial": round(sum(cost[n] for n in busy) * 1e6, 3),
                      "makespan": round(max(plan[n].end for n in busy) * 1e6, 3),
                      "streams": {n.name: plan[n].stream for n in busy}})
    return plans

"""List scheduling of a graph's nodes onto at most N streams, on modeled costs.

Nodes are taken in order of their bottom level (longest modeled path to the end of the graph, so the
critical path goes first); each goes to the stream where it can finish earliest, a dependency on another
stream costing one event. Nodes that launch nothing (views, tuple access) stay on their producer's stream
and take no time. The result is the modeled plan: stream, start and end per node.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch.fx


@dataclass
class Slot:
    stream: int
    start: float
    end: float


def bottom_levels(nodes: list[torch.fx.Node], deps: dict[torch.fx.Node, list[torch.fx.Node]],
                  cost: dict[torch.fx.Node, float]) -> dict[torch.fx.Node, float]:
    """Longest modeled path from each node to the end of the graph, the node included."""
    level = {n: cost[n] for n in nodes}
    for node in reversed(nodes):
        for pred in deps[node]:
            if pred in level:
                level[pred] = max(level[pred], cost[pred] + level[node])
    return level


def _home_stream(node: torch.fx.Node, deps: dict[torch.fx.Node, list[torch.fx.Node]],
                 plan: dict[torch.fx.Node, Slot]) -> int:
    """Where a node that launches nothing lives: with the producer of its first input."""
    for arg in node.all_input_nodes:
        if arg in plan:
            return plan[arg].stream
    return 0


def _place(node: torch.fx.Node, preds: list[torch.fx.Node], plan: dict[torch.fx.Node, Slot],
           free: list[float], seconds: float, event_s: float) -> Slot:
    """The earliest-finishing slot for `node`; ties go to its first producer's stream, then the lowest."""
    first = next((plan[p].stream for p in preds if p in plan), 0)
    best = None
    for stream in sorted(range(len(free)), key=lambda s: (s != first, s)):
        ready = max((plan[p].end + (event_s if plan[p].stream != stream else 0.0) for p in preds), default=0.0)
        start = max(ready, free[stream])
        if best is None or start + seconds < best.end - 1e-15:
            best = Slot(stream, start, start + seconds)
    return best


def _links(nodes: list[torch.fx.Node], deps: dict[torch.fx.Node, list[torch.fx.Node]]) -> tuple[dict, dict, dict, dict]:
    """(position, predecessors, count of unplaced predecessors, users) of every node, within `nodes`."""
    index = {n: i for i, n in enumerate(nodes)}
    preds = {n: [p for p in deps[n] if p in index] for n in nodes}
    waiting = {n: len(preds[n]) for n in nodes}
    users: dict[torch.fx.Node, list[torch.fx.Node]] = {n: [] for n in nodes}
    for node in nodes:
        for pred in preds[node]:
            users[pred].append(node)
    return index, preds, waiting, users


def schedule(nodes: list[torch.fx.Node], deps: dict[torch.fx.Node, list[torch.fx.Node]],
             cost: dict[torch.fx.Node, float], free_nodes: set[torch.fx.Node], count: int,
             event_s: float) -> dict[torch.fx.Node, Slot]:
    """Plan every node of `nodes` (a topological order) onto `count` streams."""
    index, preds, waiting, users = _links(nodes, deps)
    level = bottom_levels(nodes, preds, cost)
    ready = [(-level[n], index[n], n) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    plan: dict[torch.fx.Node, Slot] = {}
    free = [0.0] * count
    while ready:
        _, _, node = heapq.heappop(ready)
        if node in free_nodes:
            start = max((plan[p].end for p in preds[node]), default=0.0)
            plan[node] = Slot(_home_stream(node, preds, plan), start, start)
        else:
            plan[node] = _place(node, preds[node], plan, free, cost[node], event_s)
            free[plan[node].stream] = plan[node].end
        for user in users[node]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (-level[user], index[user], user))
    return plan


def program_order(nodes: list[torch.fx.Node], deps: dict[torch.fx.Node, list[torch.fx.Node]],
                  plan: dict[torch.fx.Node, Slot]) -> list[torch.fx.Node]:
    """A topological order that launches long runs of one stream: among the ready nodes, stay on the
    stream of the node just emitted, else take the earliest modeled start."""
    index, _, waiting, users = _links(nodes, deps)
    ready = {n for n in nodes if waiting[n] == 0}
    order: list[torch.fx.Node] = []
    current = 0
    while ready:
        node = min(ready, key=lambda n: (plan[n].stream != current, plan[n].start, index[n]))
        ready.remove(node)
        order.append(node)
        current = plan[node].stream
        for user in users[node]:
            waiting[user] -= 1
            if waiting[user] == 0:
                ready.add(user)
    return order

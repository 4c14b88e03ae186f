"""Stream and event operations that assign_streams puts into graphs, and the check that a plan has no race.

Graph nodes call `record_event(event_id, stream, *producers)` after a producer and `wait_event(event_id,
stream)` before a consumer on another stream; graphs on CUDA / Ascend devices also call `set_stream(stream,
device)` where the launching stream changes. All are registered as side effects, so dead-code elimination
keeps them. On CPU they do nothing (the graph's order is already a valid serial order); on "cuda" / "npu"
tensors they use real streams and events of `torch.cuda` / `torch.npu`. Stream 0 is the stream current when
the graph starts; streams 1.. are side streams created once per device.
"""
from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

import torch
import torch.fx

from npu_graph.pass_api import MetaKey

_local = threading.local()
_side_streams: dict[tuple[str, int], Any] = {}


def _module(device_type: str) -> ModuleType | None:
    return getattr(torch, device_type, None) if device_type in ("cuda", "npu") else None


def _stream(module: ModuleType, device: torch.device, stream: int) -> Any:
    if stream == 0:
        main = getattr(_local, "main", None)
        return main if main is not None else module.current_stream(device)
    key = (str(device), stream)
    if key not in _side_streams:
        _side_streams[key] = module.Stream(device=device)
    return _side_streams[key]


def _events() -> dict[int, Any]:
    if not hasattr(_local, "events"):
        _local.events = {}
    return _local.events


def record_event(event_id: int, stream: int, *producers: Any) -> None:
    """Record event `event_id` on `stream` once the producers (tensors launched there) are enqueued."""
    tensors = [p for p in producers if isinstance(p, torch.Tensor)]
    device = next((t.device for t in tensors if t.device.type in ("cuda", "npu")), None)
    if device is None:
        _events().pop(event_id, None)
        return
    module = _module(device.type)
    event = module.Event()
    event.record(_stream(module, device, stream))
    _events()[event_id] = (module, device, event, tensors)


def wait_event(event_id: int, stream: int) -> None:
    """Make `stream` wait for event `event_id`; the producers' memory is then also in use on `stream`."""
    entry = _events().get(event_id)
    if entry is None:
        return
    module, device, event, tensors = entry
    waiting = _stream(module, device, stream)
    waiting.wait_event(event)
    for tensor in tensors:
        tensor.record_stream(waiting)


def set_stream(stream: int, device: str) -> None:
    """Launch what follows on `stream` of `device` (stream 0 restores the stream the graph started on)."""
    dev = torch.device(device)
    module = _module(dev.type)
    if module is None:
        return
    if stream != 0 and getattr(_local, "main", None) is None:
        _local.main = module.current_stream(dev)
    module.set_stream(_stream(module, dev, stream))
    if stream == 0:
        _local.main = None


for _fn in (record_event, wait_event, set_stream):
    torch.fx.node.has_side_effect(_fn)

EVENT_OPS = (record_event, wait_event, set_stream)


def drop_host_events(gm: torch.fx.GraphModule) -> int:
    """Remove the stream and event calls from a graph (and its SuperKernel regions) whose tensors all live on
    the CPU, where they do nothing but cost a Python call each (~150 per decode step of the reference model).
    Dynamo guards on devices, so such a graph never sees device tensors. Returns how many were removed."""
    graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
    values = [n.meta.get("val") for g in graphs for n in g.nodes] + [*gm.parameters(), *gm.buffers()]
    if any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in values):
        return 0
    removed = 0
    for graph in graphs:
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target in EVENT_OPS]:
            graph.erase_node(node)
            removed += 1
    if removed:
        for module in gm.modules():
            if isinstance(module, torch.fx.GraphModule):
                module.recompile()
    return removed


def stream_of(node: torch.fx.Node) -> int:
    """The stream a node runs on: its meta["stream"], the stream argument of event ops, 0 for inputs."""
    if node.target in (record_event, wait_event, set_stream):
        return int(node.args[1] if node.target is not set_stream else node.args[0])
    return int(node.meta.get(MetaKey.STREAM, 0))


class Clocks:
    """Vector clocks over a program order: what each stream knows has completed on every stream.

    `step(node)` advances the node's stream past it (a wait_event first merges what its record knew)."""

    def __init__(self) -> None:
        self.streams: dict[int, dict[int, int]] = {}
        self.position: dict[torch.fx.Node, int] = {}
        self.recorded: dict[int, dict[int, int]] = {}

    def known(self, stream: int) -> dict[int, int]:
        return self.streams.setdefault(stream, {})

    def covers(self, stream: int, producer: torch.fx.Node) -> bool:
        """True when `stream` is ordered after `producer` (same stream, or through events)."""
        return self.known(stream).get(stream_of(producer), -1) >= self.position[producer]

    def step(self, node: torch.fx.Node) -> None:
        known = self.known(stream_of(node))
        if node.target is wait_event:
            for t, index in self.recorded.get(node.args[0], {}).items():
                known[t] = max(known.get(t, -1), index)
        s = stream_of(node)
        self.position[node] = known.get(s, -1) + 1
        known[s] = self.position[node]
        if node.target is record_event:
            self.recorded[node.args[0]] = dict(known)


def unordered_uses(graph: torch.fx.Graph, deps: dict[torch.fx.Node, list[torch.fx.Node]]) -> list[str]:
    """Every dependency (producer -> consumer, `deps` as from stream_deps.dependencies; the graph output
    needs every side-stream node) that no chain of same-stream order and record/wait events guarantees:
    each one is a race. Empty for a correct plan."""
    clocks = Clocks()
    races = []
    for node in graph.nodes:
        if node.op == "output":
            needs = [n for n in graph.nodes if n.op == "call_function" and stream_of(n) != 0]
        else:
            needs = [p for p in deps.get(node, []) if p.op != "get_attr"]
        clocks.step(node)
        for producer in needs:
            if not clocks.covers(stream_of(node), producer):
                races.append(f"{node.name} (stream {stream_of(node)}) uses {producer.name} "
                             f"(stream {stream_of(producer)}) without waiting for it")
    return races

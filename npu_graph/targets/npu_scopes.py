"""Stream, event and SuperKernel scopes of the NPU program, in eager torch_npu form or torchair graph form.

Consecutive nodes on one non-main stream (node.meta["stream"]) share one scope. Event nodes
(npu_graph.runtime.streams.record_event / wait_event) become `torch.npu.Event` record / `Stream.wait_event` in eager
form; in torchair form a wait becomes `npu_wait_tensor(<an input of the next node on the waiting stream>,
<a tensor the recorded producers made>)`. A `superkernel_N` region becomes a `super_kernel` scope (torchair)
or a commented inline region (eager). The torchair form in torchair's "reduce-overhead" graph mode (aclgraph
capture and replay; torch.compile's mode="reduce-overhead") has neither `npu_wait_tensor` nor `super_kernel`
(both are GE "max-autotune" mode scopes): events are tagged events (`torchair.ops.npu_create_tagged_event`,
recorded and waited on in their stream's scope), regions are inlined, and `forward` is compiled with
`config.mode = "reduce-overhead"`.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch.fx

from npu_graph.pass_api import MetaKey
from npu_graph.targets.npu_contract import Arg, NpuCall
from npu_graph.targets.npu_ops import Names
from npu_graph.targets.npu_signatures import TORCH_NPU_VERSION, TORCHAIR_VERSION

INDENT = "    "


def is_event(node: torch.fx.Node) -> bool:
    """True for the record_event / wait_event nodes of the stream plan."""
    target = node.target
    return (node.op == "call_function" and getattr(target, "__module__", "") == "npu_graph.runtime.streams"
            and getattr(target, "__name__", "") in ("record_event", "wait_event"))


@dataclass
class Block:
    """One node's lines (or a SuperKernel region's child blocks plus the line binding its result)."""

    node: torch.fx.Node
    lines: list[str]
    event: bool = False
    children: list[Block] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)

    @property
    def stream(self) -> int | None:
        if self.children:
            return next((c.stream for c in self.children if c.stream is not None), None)
        stream = self.node.meta.get(MetaKey.STREAM)
        return stream if isinstance(stream, int) else None


def _indent(lines: list[str], depth: int = 1) -> list[str]:
    return [INDENT * depth + line for line in lines]


class ScopeWriter:
    """Writes Blocks as a forward body in one mode ("eager" or "torchair")."""

    def __init__(self, mode: str, names: Names, graph_mode: str = "max-autotune"):
        self.mode, self.names, self.graph_mode = mode, names, graph_mode
        self.captured = mode == "torchair" and graph_mode == "reduce-overhead"
        self.counts: Counter[str] = Counter()
        self.calls: list[NpuCall] = []
        self.streams: set[int] = set()
        self.events: set[int] = set()
        self.producers: dict[int, list[str]] = {}
        self.forward_name = "_forward" if mode == "torchair" else "forward"

    def scope(self, op: str, args: list[Arg]) -> str:
        call = NpuCall(op, args)
        self.calls.append(call)
        return f"with {call.source()}:"

    def stream_scope(self, stream: int) -> str:
        self.streams.add(stream)
        self.counts["stream"] += 1
        if self.mode == "torchair":
            return self.scope("torchair.scope.npu_stream_switch", [Arg.literal(str(stream))])
        return self.scope("torch.npu.stream", [Arg(f"STREAMS[{stream}]", "expr")])

    def write(self, blocks: list[Block]) -> list[str]:
        """The body lines (indented for a function) for `blocks` in order."""
        out: list[str] = []
        group: list[Block] = []
        for i, block in enumerate(blocks):
            current = next((b.stream for b in group if b.stream is not None), None)
            joins = block.stream is None or current is None or block.stream == current
            if block.event or block.children or not joins:
                out += self.flush(group)
                group = []
            if block.event:
                out += _indent(self.event(block.node, blocks[i + 1:]))
            elif block.children:
                out += self.superkernel(block)
            else:
                group.append(block)
        return out + self.flush(group)

    def flush(self, group: list[Block]) -> list[str]:
        lines = [line for block in group for line in block.lines]
        stream = next((b.stream for b in group if b.stream is not None), 0)
        if not lines or not stream:
            return _indent(lines)
        return _indent([self.stream_scope(stream), *_indent(lines)])

    def superkernel(self, block: Block) -> list[str]:
        self.counts["superkernel"] += 1
        name = block.node.target
        body = self.write(block.children)
        if self.mode == "eager" or self.captured:
            where = "a super_kernel scope only in max-autotune (GE) mode" if self.captured else \
                "one SuperKernel in torchair graph mode (npu_program_torchair.py)"
            return _indent([f"# {name}: {where}"]) + body + _indent(block.tail)
        scope = self.scope("torchair.scope.super_kernel", [Arg.literal(name)])
        return _indent([scope]) + _indent(body) + _indent(block.tail)

    def event(self, node: torch.fx.Node, rest: list[Block]) -> list[str]:
        event, stream = node.args[0], node.args[1]
        self.events.add(event)
        self.streams.add(stream)
        if self.captured:
            return self.tagged_event(event, stream, node.target.__name__ == "record_event")
        if node.target.__name__ == "record_event":
            self.producers[event] = [self.names.text(p) for p in node.args[2:] if isinstance(p, torch.fx.Node)]
            if self.mode == "eager":
                return [f"EVENTS[{event}].record(STREAMS[{stream}])"]
            return [f"# event {event} recorded on stream {stream}: the wait below orders it"]
        if self.mode == "eager":
            return [f"STREAMS[{stream}].wait_event(EVENTS[{event}])"]
        return self.wait_tensor(event, stream, rest)

    def tagged_event(self, event: int, stream: int, record: bool) -> list[str]:
        call = NpuCall(f"torchair.ops.npu_tagged_event_{'record' if record else 'wait'}",
                       [Arg(f"EVENTS[{event}]", "expr")])
        self.calls.append(call)
        return [call.source()] if not stream else [self.stream_scope(stream), INDENT + call.source()]

    def wait_tensor(self, event: int, stream: int, rest: list[Block]) -> list[str]:
        consumer = next((b.node for b in rest if not b.event and (b.stream or 0) == stream
                         and b.node.all_input_nodes), None)
        producers = self.producers.get(event, [])
        if consumer is None or not producers:
            return [f"# event {event}: no producer tensor or no later node on stream {stream} to order"]
        call = NpuCall("torchair.scope.npu_wait_tensor", [Arg.tensor(self.names.text(consumer.all_input_nodes[0]),
                                                                     None), Arg.tensor(producers[0], None)])
        self.calls.append(call)
        if not stream:
            return [call.source()]
        return [self.stream_scope(stream), INDENT + call.source()]

    def header(self, graph: str, imports: list[str], composites: dict[str, str]) -> list[str]:
        mode = f"torchair {self.graph_mode} graph mode" if self.mode == "torchair" else "eager torch_npu"
        lines = [f'"""NPU program for {graph} ({mode}), written by ascend_dsa against torch_npu {TORCH_NPU_VERSION} '
                 f"/ torchair {TORCHAIR_VERSION} signatures.",
                 "", "Not run on hardware: generated and contract-checked on a machine without torch_npu."]
        lines += [f"Composite (no torch_npu counterpart): {op}: {why}" for op, why in sorted(composites.items())]
        lines += ['"""', "import torch", "import torch_npu  # noqa: F401  (registers torch.npu and the npu_* ops)"]
        lines += ["import torchair"] if self.mode == "torchair" else []
        lines += [f"import {module}" for module in imports]
        if self.captured:
            lines += self.tagged_events(graph)
        if self.mode == "eager":
            streams = ", ".join(f"{s}: torch.npu.Stream()" for s in sorted(self.streams - {0}))
            lines += ["", f"STREAMS = {{0: torch.npu.current_stream(){', ' if streams else ''}{streams}}}",
                      f"EVENTS = {{{', '.join(f'{e}: torch.npu.Event()' for e in sorted(self.events))}}}"]
        return [*lines, "", ""]

    def tagged_events(self, graph: str) -> list[str]:
        """The module-level tagged events of reduce-overhead mode (a tag may be created once per process)."""
        events = []
        for event in sorted(self.events):
            call = NpuCall("torchair.ops.npu_create_tagged_event", [], {"tag": Arg(f"TAG + '_{event}'", "expr")})
            self.calls.append(call)
            events.append(f"{event}: {call.source()}")
        return ["import uuid", "", f"TAG = {graph!r} + '_' + uuid.uuid4().hex[:8]",
                f"EVENTS = {{{', '.join(events)}}}"] if events else []

    def footer(self) -> list[str]:
        if self.mode != "torchair":
            return []
        if self.captured:
            config = NpuCall("torchair.CompilerConfig", [])
            backend = NpuCall("torchair.get_npu_backend", [], {"compiler_config": Arg("config", "expr")})
            self.calls += [config, backend]
            return ["", "", f"config = {config.source()}", 'config.mode = "reduce-overhead"',
                    f"forward = torch.compile(_forward, dynamic=False, backend={backend.source()})"]
        config = NpuCall("torchair.CompilerConfig", [])
        backend = NpuCall("torchair.get_npu_backend", [], {"compiler_config": Arg(config.source(), "expr")})
        self.calls += [config, backend]
        return ["", "", f"forward = torch.compile(_forward, dynamic=False, backend={backend.source()})"]

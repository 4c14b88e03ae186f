"""NPU program generation: the final graph as readable Python source that calls torch_npu / torchair.

Two forms come from one walk over the graph. "eager" (npu_program.py): streams are `torch.npu.Stream`
objects entered with `torch.npu.stream`, cross-stream dependencies `torch.npu.Event` record/wait, SuperKernel
regions inlined with a comment. "torchair" (npu_program_torchair.py): the same body in torchair's graph mode,
with `npu_stream_switch` scopes, `npu_wait_tensor` for waits, `super_kernel` scopes, and `forward` compiled
with `torchair.get_npu_backend`. Weights the layout plan put in FRACTAL_NZ are cast once, in `prologue`, by
`npu_format_cast(w, 29)`. Nothing here imports torch_npu: the source does, when it is executed.
"""
from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from npu_graph.pass_api import MetaKey
from npu_graph.targets.npu_contract import Arg, NpuCall
from npu_graph.targets.npu_op_table import lower_node
from npu_graph.targets.npu_ops import Names
from npu_graph.targets.npu_scopes import Block, ScopeWriter, is_event
from npu_graph.targets.npu_signatures import ACL_FORMAT_FRACTAL_NZ, TORCH_NPU_VERSION, TORCHAIR_VERSION

MODES = ("eager", "torchair")


@dataclass
class NpuProgram:
    """The generated sources, every torch_npu call they make, what stayed composite and what runs as torch ops
    on the device (`decomposed`, npu_kda)."""

    name: str
    sources: dict[str, str]
    calls: list[NpuCall]
    composites: dict[str, str]
    nz_inputs: tuple[int, ...]
    scopes: Counter[str] = field(default_factory=Counter)
    scope_calls: list[NpuCall] = field(default_factory=list)
    decomposed: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ops = Counter(c.op for c in self.calls)
        return {"torch_npu": TORCH_NPU_VERSION, "torchair": TORCHAIR_VERSION, "op_calls": len(self.calls),
                "calls_by_op": dict(sorted(ops.items())), "unmapped_ops": dict(sorted(self.composites.items())),
                "decomposed_ops": dict(sorted(self.decomposed.items())),
                "nz_weights": len(self.nz_inputs), "stream_scopes": self.scopes["stream"],
                "superkernel_scopes": self.scopes["superkernel"], "executed": False,
                "verified": "generated and contract-checked against the pinned signatures; not run on hardware"}


def _is_nz(node: torch.fx.Node) -> bool:
    layout = node.meta.get(MetaKey.LAYOUT)
    return node.op == "placeholder" and isinstance(layout, dict) and layout.get("format") == "FRACTAL_NZ"


def _callable_text(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target.namespace}.{target._opname}.{target._overloadname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"torch.ops.{target._qualified_op_name.replace('::', '.')}"
    module = getattr(target, "__module__", None) or "builtins"
    if module == "_operator":
        module = "operator"
    return f"{module}.{target.__qualname__}" if module != "builtins" else target.__qualname__


class _Walker:
    """Turns graph nodes into Blocks of lines (one stream each), sharing names across SuperKernel regions."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm, self.names, self.calls, self.composites = gm, Names(), [], {}
        self.decomposed: dict[str, str] = {}
        self.imports: set[str] = set()
        self.constants: dict[str, str] = {}

    def bind(self, node: torch.fx.Node, name: str) -> None:
        self.names.env[node] = name
        self.names.used.add(name)

    def node_lines(self, node: torch.fx.Node) -> list[str]:
        target, text, lhs = node.target, self.names.text, self.names.env[node]
        if node.op == "get_attr":
            return [f"{lhs} = self.{target}"]
        if target is operator.getitem:
            return [f"{lhs} = {text(node.args[0])}[{text(node.args[1])}]"]
        if isinstance(target, torch._ops.OpOverload) and target.namespace == "ascend_dsa":
            emission = lower_node(node, self.names)
            self.calls += emission.calls
            self.constants.update(emission.constants)
            if emission.composite:
                self.composites[target._opname] = emission.composite
            if emission.decomposed:
                self.decomposed[target._opname] = emission.decomposed
            return emission.lines
        call = _callable_text(target)
        if "." in call and not call.startswith("torch."):
            self.imports.add(call.rsplit(".", 1)[0])
        args = [text(a) for a in node.args] + [f"{k}={text(v)}" for k, v in node.kwargs.items()]
        return [f"{lhs} = {call}({', '.join(args)})"]

    def blocks(self, graph: torch.fx.Graph, prefix: str = "") -> list[Block]:
        out: list[Block] = []
        for node in graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            self.bind(node, prefix + node.name)
            if node.op == "call_module" and node.target.startswith("superkernel_"):
                out.append(self.superkernel(node))
            elif is_event(node):
                out.append(Block(node, [], event=True))
            else:
                out.append(Block(node, self.node_lines(node)))
        return out

    def superkernel(self, node: torch.fx.Node) -> Block:
        sub = getattr(self.gm, node.target)
        inner = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for placeholder, arg in zip(inner, node.args):
            self.names.env[placeholder] = self.names.text(arg)
        blocks = self.blocks(sub.graph, prefix=f"{node.target}_")
        result = self.names.text(next(n for n in sub.graph.nodes if n.op == "output").args[0])
        return Block(node, [], children=blocks, tail=[f"{self.names.env[node]} = {result}"])


def _signature_lines(walker: _Walker, gm: torch.fx.GraphModule) -> tuple[list[str], list[str], tuple[int, ...]]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = []
    for node in placeholders:
        walker.bind(node, node.name)
        params.append(node.name)
    nz = tuple(i for i, n in enumerate(placeholders) if _is_nz(n))
    hoisted = [f"{placeholders[i].name}_nz" for i in nz]
    for i, name in zip(nz, hoisted):
        walker.names.env[placeholders[i]] = name
    return params, hoisted, nz


def _prologue(placeholders: list[str], nz: tuple[int, ...], walker: _Walker) -> list[str]:
    if not nz:
        return []
    args = ", ".join(placeholders[i] for i in nz)
    casts = []
    for i in nz:
        call = NpuCall("torch_npu.npu_format_cast", [Arg.tensor(placeholders[i], None),
                                                     Arg.literal(ACL_FORMAT_FRACTAL_NZ)], node=placeholders[i])
        walker.calls.append(call)
        casts.append(call.source())
    return ["def prologue(self, " + args + "):",
            '    """Once per weight version: planned weights to FRACTAL_NZ (ACL format 29)."""',
            f"    return ({', '.join(casts)},)", "", ""]


def generate(gm: torch.fx.GraphModule, name: str, graph_mode: str = "max-autotune") -> NpuProgram:
    """Both program forms for a final pipeline graph (does not modify `gm`); the torchair form in torchair's
    `graph_mode` ("max-autotune" or "reduce-overhead", npu_scopes)."""
    walker = _Walker(gm)
    params, hoisted, nz = _signature_lines(walker, gm)
    prologue = _prologue(params, nz, walker)
    blocks = walker.blocks(gm.graph)
    output = walker.names.text(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    sources, scopes, scope_calls = {}, Counter(), []
    for mode in MODES:
        writer = ScopeWriter(mode, walker.names, graph_mode)
        body = writer.write(blocks)
        header = writer.header(name, sorted(walker.imports), walker.composites)
        signature = ", ".join(["self", *params, *hoisted])
        forward = [f"def {writer.forward_name}({signature}):", *body, f"    return {output}", *writer.footer()]
        scopes, scope_calls = writer.counts, scope_calls + writer.calls
        constants = [f"{name} = {expr}" for name, expr in walker.constants.items()]
        sources[mode] = "\n".join([*header, *constants, *([""] * 2 * bool(constants)), *prologue, *forward]) + "\n"
    return NpuProgram(name, sources, walker.calls, walker.composites, nz, scopes, scope_calls, walker.decomposed)

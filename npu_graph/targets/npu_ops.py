"""Each `ascend_dsa` op node -> the source lines and torch_npu calls that stand for it in the NPU program.

Argument names are converted from our schemas to the pinned torch_npu ones (npu_signatures), dtypes the pinned
op does not take are cast before the call (labelled `# adapt:`), and outputs whose layout differs (MX scales,
softmax statistics) are reshaped back to ours. An op with no torch_npu counterpart, or a case the pinned op
cannot express, keeps its `torch.ops.ascend_dsa` composite call, labelled `# composite:` with the reason; a few
run as torch ops on the device instead, labelled `# decomposition:` (npu_kda).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from npu_graph.targets.npu_contract import Arg, NpuCall
from npu_graph.targets.npu_signatures import HALF


@dataclass
class Emission:
    """What one node becomes: program lines, the torch_npu calls among them, why it stayed composite (or was
    decomposed into torch ops), and the module-level constants its lines read (name -> expression, evaluated once
    when the program is loaded)."""

    lines: list[str] = field(default_factory=list)
    calls: list[NpuCall] = field(default_factory=list)
    composite: str = ""
    decomposed: str = ""
    constants: dict[str, str] = field(default_factory=dict)


class Names:
    """The program's expression for each graph node, and fresh temporaries."""

    def __init__(self) -> None:
        self.env: dict[torch.fx.Node, str] = {}
        self.used: set[str] = set()

    def fresh(self, stem: str) -> str:
        index = 0
        while f"{stem}_{index}" in self.used:
            index += 1
        self.used.add(f"{stem}_{index}")
        return f"{stem}_{index}"

    def text(self, value: Any) -> str:
        """Source for an argument: node names, literals, dtypes, devices mapped to the NPU."""
        if isinstance(value, torch.fx.Node):
            return self.env[value]
        if isinstance(value, (list, tuple)):
            inner = ", ".join(self.text(v) for v in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
        if isinstance(value, torch.device):
            return 'torch.device("npu")'
        if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
            return str(value)
        return repr(value)


def bound_args(node: torch.fx.Node) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in."""
    values: dict[str, Any] = {}
    positional = [a for a in node.target._schema.arguments if not a.kwarg_only]
    for i, arg in enumerate(node.target._schema.arguments):
        if not arg.kwarg_only and i < len(node.args):
            values[arg.name] = node.args[positional.index(arg)]
        elif arg.name in node.kwargs:
            values[arg.name] = node.kwargs[arg.name]
        else:
            values[arg.name] = arg.default_value if arg.has_default_value() else None
    return values


def _dtype(value: Any) -> torch.dtype | None:
    val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def used_outputs(node: torch.fx.Node) -> set[int]:
    """Output positions of a multi-output node that are read: those some getitem reads, or every one when the tuple
    itself is used (returned whole, or handed to another call)."""
    if any(u.target is not operator.getitem for u in node.users):
        return set(range(len(node.meta["val"])))
    return {u.args[1] for u in node.users if u.target is operator.getitem and u.users}


class Lowering:
    """Helpers shared by the per-op lowerings: tensor arguments with casts, and the call line."""

    def __init__(self, node: torch.fx.Node, names: Names):
        self.node, self.names, self.out = node, names, Emission()

    def tensor(self, value: Any, want: torch.dtype | None = None, why: str = "") -> Arg:
        """A tensor argument (graph node or an Arg already emitted), cast to `want` when it differs."""
        if value is None:
            return Arg.literal(None)
        if isinstance(value, Arg):
            text, dtype = value.text, value.dtype
        else:
            text, dtype = self.names.text(value), _dtype(value)
        if want is not None and dtype is not None and dtype != want:
            cast = self.names.fresh(f"{self.node.name}_cast")
            self.out.lines.append(f"{cast} = {text}.to({want})  # adapt: {why or 'dtype the pinned op takes'}")
            return Arg.tensor(cast, want)
        return Arg.tensor(text, dtype)

    def value(self, value: Any) -> Arg:
        """A non-tensor argument: a literal, or an expression when it is a graph value (a symbolic size)."""
        if isinstance(value, Arg):
            return value
        if isinstance(value, torch.fx.Node):
            return Arg(self.names.text(value), "expr")
        return Arg.literal(value)

    def line(self, text: str) -> None:
        self.out.lines.append(text)

    def constant(self, name: str, expr: str) -> Arg:
        """A module-level constant of the program (computed once at load, e.g. a communicator name)."""
        self.out.constants[name] = expr
        return Arg(name, "expr")

    def call(self, op: str, args: list[Arg], kwargs: dict[str, Any], result: str | None = None) -> str:
        call = NpuCall(op, [self.value(a) for a in args], {k: self.value(v) for k, v in kwargs.items()},
                       node=self.node.name)
        result = result or self.names.fresh(f"{self.node.name}_npu")
        self.out.lines.append(f"{result} = {call.source()}")
        self.out.calls.append(call)
        return result

    def assign(self, expr: str) -> Emission:
        self.out.lines.append(f"{self.names.env[self.node]} = {expr}")
        return self.out


def half_dtype(*values: Any) -> torch.dtype:
    """The half dtype a group of tensors is cast to: the first one's when it is half, else bfloat16."""
    first = _dtype(values[0])
    return first if first in HALF else torch.bfloat16


def composite(node: torch.fx.Node, names: Names, reason: str) -> Emission:
    """Keep the ascend_dsa op itself (CPU composite), labelled with the reason."""
    args = ", ".join([names.text(a) for a in node.args] + [f"{k}={names.text(v)}" for k, v in node.kwargs.items()])
    name = node.target._opname
    line = f"{names.env[node]} = torch.ops.ascend_dsa.{name}.{node.target._overloadname}({args})"
    return Emission([f"# composite: {reason}", line], composite=reason)

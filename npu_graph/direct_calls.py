"""Direct calls of the fused ops in the CPU runtime.

The generated source calls `torch.ops.ascend_dsa.<op>.default(...)`. Going through torch.library's dispatcher
costs ~20-35 µs a call (autograd wrapper, redispatch, schema checks), which decode-sized tensors do not
amortize: a decode step calls ~40 fused ops. When the runtime builds a CompiledGraph it binds each such call
to the op's own Python implementation instead: the same function the dispatcher ends up in, so results are
identical. (The runtime runs the graph inside `kernels.checks.shapes_checked_at_trace`, so the ops skip the
static argument checks their fake implementations made at trace time.) The stored source (and the cache)
keep the `torch.ops` form. `bind_aten_calls` does the same for the ATen calls: each `torch.ops.aten.*` overload
is bound once to its Python binding where that takes the same arguments (PYTHON_BINDINGS), else to the C++
callable its `__call__` forwards to; the overloads whose kernels fork a thread team for tiny work run small
calls on one thread (npu_graph.serial_calls).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch._library import custom_ops

from npu_graph.serial_calls import serial_when_small

_CALL = re.compile(r"torch\.ops\.ascend_dsa\.(\w+)\.default\(")
_ATEN_CALL = re.compile(r"torch\.ops\.aten\.(\w+)\.(\w+)\(")
PREFIX = "_ascend_dsa_direct_"
ATEN_PREFIX = "_aten_"


def implementation(op_name: str) -> Callable[..., Any] | None:
    """The Python implementation registered for `ascend_dsa::<op_name>`, if it is a custom_op."""
    opdef = custom_ops.OPDEFS.get(f"ascend_dsa::{op_name}")
    return None if opdef is None else opdef._init_fn


def bind_direct_calls(source: str) -> tuple[str, dict[str, Callable[..., Any]]]:
    """The source with every fused-op call that has a Python implementation rewritten to call it directly,
    and the functions to put in the namespace it runs in."""
    functions = {PREFIX + name: fn for name in set(_CALL.findall(source)) for fn in [implementation(name)]
                 if fn is not None}

    def replace(match: re.Match) -> str:
        name = PREFIX + match.group(1)
        return f"{name}(" if name in functions else match.group(0)

    return _CALL.sub(replace, source), functions


def profiler_labels(functions: dict[str, Callable[..., Any]]) -> dict[str, str]:
    """The torch.profiler event name of each directly bound fused op (`ascend_dsa::<op>`, as the dispatcher
    names it), for npu_graph.profiling."""
    return {name: "ascend_dsa::" + name[len(PREFIX):] for name in functions if name.startswith(PREFIX)}


# Overloads that torch's Python bindings reach with the same arguments (as the generated source passes them:
# positionally, plus keywords the binding shares) and the same kernel, ~0.4 us a call faster than
# OpOverload._op: these are most of a decode step's ~300 small ATen calls.
PYTHON_BINDINGS: dict[str, Callable[..., Any]] = {
    "view.default": torch.Tensor.view, "unsqueeze.default": torch.unsqueeze, "mul.Tensor": torch.mul,
    "add.Tensor": torch.add, "sub.Tensor": torch.sub, "cat.default": torch.cat, "stack.default": torch.stack,
    "select.int": torch.select, "bmm.default": torch.bmm, "permute.default": torch.permute,
    "transpose.int": torch.transpose, "sum.dim_IntList": torch.sum, "pow.Tensor_Scalar": torch.pow,
    "sigmoid.default": torch.sigmoid, "exp.default": torch.exp, "rsqrt.default": torch.rsqrt,
    "cos.default": torch.cos, "sin.default": torch.sin,
}


def aten_callable(op: str, overload: str) -> Callable[..., Any]:
    """The fastest callable for `torch.ops.aten.<op>.<overload>`: its Python binding (PYTHON_BINDINGS), else the
    overload's C++ callable."""
    return PYTHON_BINDINGS.get(f"{op}.{overload}") or getattr(getattr(torch.ops.aten, op), overload)._op


def bind_aten_calls(source: str) -> tuple[str, dict[str, Callable[..., Any]]]:
    """The source with every `torch.ops.aten.<op>.<overload>(` call calling `aten_callable` bound once under a
    plain name: no attribute chain and no Python frame per call (~0.6 of ~2.4 us for a small op, ~1 us for the
    ones with Python bindings)."""
    functions: dict[str, Callable[..., Any]] = {}

    def replace(match: re.Match) -> str:
        name = f"{ATEN_PREFIX}{match.group(1)}_{match.group(2)}"
        if name not in functions:
            overload = f"{match.group(1)}.{match.group(2)}"
            functions[name] = serial_when_small(overload, aten_callable(match.group(1), match.group(2)))
        return f"{name}("

    return _ATEN_CALL.sub(replace, source), functions

"""Direct calls of the fused ops in the CPU runtime.

The generated source calls `torch.ops.ascend_dsa.<op>.default(...)`. Going through torch.library's dispatcher
costs ~20-35 µs a call (autograd wrapper, redispatch, schema checks), which decode-sized tensors do not
amortize: a decode step calls ~40 fused ops. When the runtime builds a CompiledGraph it binds each such call
to the op's own Python implementation instead: the same function the dispatcher ends up in, so results are
identical. (The runtime runs the graph inside `kernels.checks.shapes_checked_at_trace`, so the ops skip the
static argument checks their fake implementations made at trace time.) The stored source (and the cache)
keep the `torch.ops` form. `bind_aten_calls` does the same for the ATen calls: each `torch.ops.aten.*` overload
is bound once to the C++ callable its `__call__` forwards to.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch._library import custom_ops

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


def bind_aten_calls(source: str) -> tuple[str, dict[str, Callable[..., Any]]]:
    """The source with every `torch.ops.aten.<op>.<overload>(` call calling the overload's C++ callable
    (`OpOverload._op`, what `OpOverload.__call__` forwards to) bound once under a plain name: no attribute chain
    and no Python frame per call (~0.6 of ~2.4 us for a small op)."""
    functions: dict[str, Callable[..., Any]] = {}

    def replace(match: re.Match) -> str:
        name = f"{ATEN_PREFIX}{match.group(1)}_{match.group(2)}"
        if name not in functions:
            functions[name] = getattr(getattr(torch.ops.aten, match.group(1)), match.group(2))._op
        return f"{name}("

    return _ATEN_CALL.sub(replace, source), functions

"""`auto_functionalized_v2` calls that copy nothing, run as the op's own call.

A call of a custom op that writes its arguments stays `auto_functionalized_v2(op, ..., _all_bases=[...])` in a
compiled graph; where the graph's passes found that no base needs a copy (`_only_clone_these_bases=()`,
passes/reinplace_functionalized.py) the call is the op on views of the bases, returning the op's results and then
the bases. torch's higher-order op does that through its dispatcher and pytree walks, ~30-60 µs a call on a
decode step whose own work is a few µs (vLLM's linears and rotary are such calls); `call` does the same with the
views rebuilt as torch rebuilds them (the argument's base itself, its alias, a slice or an as_strided view, as
the call's `_<arg>_*` keywords say), so the op sees the same tensors. Every other call (bases to copy, out=
ops, higher-order ops as the op) goes to torch's higher-order op itself.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

HOP = torch.ops.higher_order.auto_functionalized_v2
aten = torch.ops.aten


@functools.cache
def mutable_arguments(op: Any) -> tuple[tuple[str, bool], ...] | None:
    """(name, is a list of tensors) of each argument `op` writes, as its schema says; None when the call is not the
    op's own (a higher-order op, an out= op)."""
    if not isinstance(op, torch._ops.OpOverload) or torch._library.utils.is_out(op):
        return None
    found = []
    for arg in op._schema.arguments:
        if arg.alias_info is not None and arg.alias_info.is_write:
            found.append((arg.name, torch._library.utils.is_tensorlist_like_type(arg.type)))
    return tuple(found)


def _view(prefix: str, kwargs: dict[str, Any], bases: list[torch.Tensor]) -> torch.Tensor | None:
    """The argument described by the `<prefix>_*` keywords (popped from kwargs), on `bases`."""
    index = kwargs.pop(f"{prefix}_base_index")
    if index is None:
        return None
    base = bases[index]
    if kwargs.pop(f"{prefix}_alias", None) is not None:
        return aten.alias.default(base)
    if f"{prefix}_storage_offset" in kwargs:
        size, stride = kwargs.pop(f"{prefix}_size"), kwargs.pop(f"{prefix}_stride")
        return torch.as_strided(base, size, stride, kwargs.pop(f"{prefix}_storage_offset"))
    if f"{prefix}_slice_dim" in kwargs:
        dim, start = kwargs.pop(f"{prefix}_slice_dim"), kwargs.pop(f"{prefix}_slice_start")
        return aten.slice.Tensor(base, dim, start, kwargs.pop(f"{prefix}_slice_end"))
    return base


def _written(name: str, is_list: bool, kwargs: dict[str, Any], bases: list[torch.Tensor]) -> Any:
    if not is_list:
        return _view(f"_{name}", kwargs, bases)
    length = kwargs.pop(f"_{name}_length")
    return None if length is None else [_view(f"_{name}_{i}", kwargs, bases) for i in range(length)]


def call(op: Any, **kwargs: Any) -> tuple[Any, ...]:
    """What `auto_functionalized_v2(op, **kwargs)` returns (module docstring)."""
    written = mutable_arguments(op)
    if written is None or kwargs.get("_only_clone_these_bases") != ():
        return HOP(op, **kwargs)
    del kwargs["_only_clone_these_bases"]
    bases = kwargs.pop("_all_bases")
    for name, is_list in written:
        kwargs[name] = _written(name, is_list, kwargs, bases)
    out = op(**kwargs)
    return (*out, *bases) if isinstance(out, tuple) else (out, *bases)

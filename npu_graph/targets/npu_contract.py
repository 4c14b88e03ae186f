"""Contract checker: every torch_npu / torchair call of a generated NPU program against the pinned table.

A call is recorded as an NpuCall (op name, positional and keyword arguments, each an Arg that knows whether it
is a tensor and its dtype, a literal value, or an expression only known at run time). `check_call` raises
NpuContractError naming the op, the graph node and the argument when a name is unknown, a required argument
is missing, a keyword-only option is passed by position, or a dtype, layout or mode is outside the table.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from npu_graph.targets.npu_signatures import SIGNATURES, Param, Signature

_TENSOR_TYPES = ("Tensor", "Tensor?", "Tensor[]")


class NpuContractError(ValueError):
    """A generated NPU call does not match the pinned torch_npu / torchair signature."""


@dataclass(frozen=True)
class Arg:
    """One argument as the program passes it: `text` is its source; kind is "tensor", "tensors" (a list of
    tensors), "none", "value" (a literal) or "expr" (a non-tensor value known only at run time)."""

    text: str
    kind: str
    dtype: torch.dtype | None = None
    value: object = None
    dtypes: tuple[torch.dtype, ...] = ()

    @staticmethod
    def tensor(text: str, dtype: torch.dtype | None) -> Arg:
        return Arg(text, "tensor", dtype=dtype)

    @staticmethod
    def literal(value: object) -> Arg:
        return Arg("None" if value is None else repr(value) if not isinstance(value, torch.dtype) else str(value),
                   "none" if value is None else "value", value=value)


@dataclass
class NpuCall:
    """One call the program makes, with the graph node it lowers."""

    op: str
    args: list[Arg]
    kwargs: dict[str, Arg] = field(default_factory=dict)
    node: str = ""

    def source(self) -> str:
        parts = [a.text for a in self.args] + [f"{k}={a.text}" for k, a in self.kwargs.items()]
        flat = f"{self.op}({', '.join(parts)})"
        if len(flat) <= 100:
            return flat
        return f"{self.op}(\n        " + ",\n        ".join(parts) + ")"


def _fail(call: NpuCall, message: str) -> NpuContractError:
    where = f" (lowering node {call.node!r})" if call.node else ""
    return NpuContractError(f"NPU program: {call.op}{where}: {message}")


def _bind(sig: Signature, call: NpuCall) -> dict[str, Arg]:
    positional = [p for p in sig.params if p.kind == "positional"]
    if len(call.args) > len(positional):
        extra = [p.name for p in sig.params[len(positional):]][: len(call.args) - len(positional)]
        raise _fail(call, f"{len(call.args)} positional arguments but only {len(positional)} may be positional "
                          f"({[p.name for p in positional]}); pass {extra} by keyword")
    bound = {p.name: a for p, a in zip(positional, call.args)}
    for name, arg in call.kwargs.items():
        if name not in sig.by_name:
            raise _fail(call, f"unknown argument {name!r}; torch_npu {sig.version} takes {list(sig.by_name)}")
        if name in bound:
            raise _fail(call, f"argument {name!r} given both by position and by keyword")
        bound[name] = arg
    missing = [p.name for p in sig.params if p.required and p.name not in bound]
    if missing:
        raise _fail(call, f"missing required arguments {missing}")
    return bound


def _check_tensor(call: NpuCall, param: Param, arg: Arg) -> None:
    if arg.kind == "none":
        if param.required and param.type == "Tensor":
            raise _fail(call, f"argument {param.name!r} is a required tensor; got None")
        return
    expected = "tensors" if param.type == "Tensor[]" else "tensor"
    if arg.kind != expected:
        raise _fail(call, f"argument {param.name!r} must be a {param.type}; got {arg.text!r}")
    dtypes = arg.dtypes if arg.kind == "tensors" else (arg.dtype,)
    for dtype in dtypes:
        if param.dtypes and dtype is not None and dtype not in param.dtypes:
            allowed = [str(d).replace("torch.", "") for d in param.dtypes]
            raise _fail(call, f"argument {param.name!r} has dtype {str(dtype).replace('torch.', '')}; "
                              f"the pinned op takes {allowed} (cast it before the call)")


def _check_value(call: NpuCall, param: Param, arg: Arg) -> None:
    if arg.kind in ("tensor", "tensors"):
        raise _fail(call, f"argument {param.name!r} is a {param.type}, not a tensor")
    if arg.kind != "value":
        return
    if param.choices is not None and arg.value not in param.choices:
        raise _fail(call, f"argument {param.name}={arg.value!r} is not supported; choices {list(param.choices)}")
    if param.bounds is not None and isinstance(arg.value, int):
        low, high = param.bounds
        if not low <= arg.value <= high:
            raise _fail(call, f"argument {param.name}={arg.value} is outside [{low}, {high}]")


def check_call(call: NpuCall) -> Signature:
    """Validate one call against SIGNATURES; returns its signature, raises NpuContractError."""
    sig = SIGNATURES.get(call.op)
    if sig is None:
        raise _fail(call, f"not in the pinned signature table; known ops: {sorted(SIGNATURES)}")
    bound = _bind(sig, call)
    for name, arg in bound.items():
        param = sig.by_name[name]
        if param.type in _TENSOR_TYPES:
            _check_tensor(call, param, arg)
        else:
            _check_value(call, param, arg)
    dtypes = {bound[n].dtype for n in sig.same_dtype if n in bound and bound[n].kind == "tensor"}
    if len(dtypes) > 1:
        raise _fail(call, f"arguments {list(sig.same_dtype)} must share one dtype; got "
                          f"{sorted(str(d).replace('torch.', '') for d in dtypes)}")
    return sig


def check_calls(calls: list[NpuCall]) -> None:
    """Validate every call; the first mismatch raises."""
    for call in calls:
        check_call(call)

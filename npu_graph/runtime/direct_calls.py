"""The CPU runtime's binders: what each name in a generated source's binding header
(npu_graph.targets.cpu_bindings) stands for when the graph is loaded.

`DIRECT` is what runs. A fused op is its own Python implementation, not `torch.ops.ascend_dsa.<op>.default`:
going through torch.library's dispatcher costs ~20-35 us a call (autograd wrapper, redispatch, schema checks),
which decode-sized tensors do not amortize (a decode step calls ~40 fused ops); it is the function the
dispatcher ends up in, so results are identical (the runtime runs the graph inside
`kernels.checks.shapes_checked_at_trace`, so the ops skip the static argument checks their fake implementations
made at trace time). An ATen overload is its Python binding where that takes the same arguments
(PYTHON_BINDINGS), else the C++ callable its `__call__` forwards to; the overloads whose kernels fork a thread
team for tiny work run small calls on one thread (npu_graph.runtime.serial_calls). A native kernel (skinny_mm,
skinny_bmm, depthwise_conv1d, dense_attention) is its native entry where the library is loaded, else the ATen
overload. A call of an op that writes its arguments (`auto_functionalized_v2`) is
npu_graph.runtime.functionalized.call, which calls the op itself where nothing is copied.

`AS_TRACED` binds every name to the torch.ops overload itself: the source as Dynamo and Inductor trace it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._library import custom_ops

from npu_graph.kernels.aten import dense_attention, depthwise_conv1d, skinny_bmm, skinny_mm
from npu_graph.runtime import functionalized
from npu_graph.runtime.serial_calls import serial_when_small
from npu_graph.targets.cpu_bindings import FUSED_PREFIX

NATIVE_MODULES = {"skinny_mm": skinny_mm, "skinny_bmm": skinny_bmm, "depthwise_conv1d": depthwise_conv1d,
                  "dense_attention": dense_attention}


def implementation(op_name: str) -> Callable[..., Any] | None:
    """The Python implementation registered for `ascend_dsa::<op_name>`, if it is a custom_op. An op with dtype
    arguments gets them as torch.dtype even where the source passes ScalarType codes (Inductor's generated module
    writes `dst_type=24`; the dispatcher converts such codes, a direct call has to)."""
    opdef = custom_ops.OPDEFS.get(f"ascend_dsa::{op_name}")
    if opdef is None:
        return None
    schema = getattr(torch.ops.ascend_dsa, op_name).default._schema
    dtypes = {(i, a.name) for i, a in enumerate(schema.arguments) if str(a.real_type).startswith("ScalarType")}
    return opdef._init_fn if not dtypes else _with_dtypes(opdef._init_fn, dtypes)


@functools.cache
def dtype_of_code(code: int) -> torch.dtype:
    """The torch.dtype of a ScalarType code, as the dispatcher converts it."""
    return torch.ops.aten.empty.memory_format([0], dtype=code).dtype


def _with_dtypes(fn: Callable[..., Any], dtypes: set[tuple[int, str]]) -> Callable[..., Any]:
    """fn with the arguments at `dtypes` (position, name) given as ScalarType codes turned into torch.dtype."""
    positions, names = {i for i, _ in dtypes}, {n for _, n in dtypes}

    def call(*args: Any, **kwargs: Any) -> Any:
        args = tuple(dtype_of_code(a) if i in positions and type(a) is int else a for i, a in enumerate(args))
        kwargs = {k: dtype_of_code(v) if k in names and type(v) is int else v for k, v in kwargs.items()}
        return fn(*args, **kwargs)

    return call


def profiler_labels(namespace: dict[str, Any]) -> dict[str, str]:
    """The torch.profiler event name of each fused op bound in a loaded graph's namespace (`ascend_dsa::<op>`,
    as the dispatcher names it), for npu_graph.runtime.profiling."""
    return {name: "ascend_dsa::" + name[len(FUSED_PREFIX):] for name in namespace if name.startswith(FUSED_PREFIX)}


def _to_copy(x: torch.Tensor, dtype: torch.dtype | None = None, layout: torch.layout | None = None,
             device: torch.device | None = None, pin_memory: bool | None = None, non_blocking: bool = False,
             memory_format: torch.memory_format | None = None) -> torch.Tensor:
    """aten._to_copy through Tensor.to(copy=True), which calls it with the same arguments (~3x less binding cost
    than the overload's generic path); a layout or pinned memory goes to the overload."""
    if layout is None and not pin_memory:
        return x.to(device=device, dtype=dtype, non_blocking=non_blocking, copy=True, memory_format=memory_format)
    return torch.ops.aten._to_copy.default._op(x, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory,
                                               non_blocking=non_blocking, memory_format=memory_format)


# Overloads that torch's Python bindings reach with the same arguments (as the generated source passes them:
# positionally, plus keywords the binding shares) and the same kernel: the bindings' generated argument parsers
# cost ~1-2x less than the overloads' generic (schema-driven) path, ~3x for factories and _to_copy. These are
# most of a decode step's ~200 small ATen calls. (_unsafe_view is view without autograd's alias record: the
# same strides, storage and errors.)
PYTHON_BINDINGS: dict[str, Callable[..., Any]] = {
    "view.default": torch.Tensor.view, "_unsafe_view.default": torch.Tensor.view, "reshape.default": torch.reshape,
    "unsqueeze.default": torch.unsqueeze, "squeeze.dim": torch.squeeze, "squeeze.dims": torch.squeeze,
    "select.int": torch.select, "permute.default": torch.permute, "transpose.int": torch.transpose,
    "split_with_sizes.default": torch.split_with_sizes, "sym_size.int": torch.Tensor.size,
    "cat.default": torch.cat, "stack.default": torch.stack, "clone.default": torch.clone, "_to_copy.default": _to_copy,
    "slice_scatter.default": torch.slice_scatter, "constant_pad_nd.default": torch.constant_pad_nd,
    "embedding.default": torch.embedding, "index_select.default": torch.index_select, "gather.default": torch.gather,
    "scatter.value": torch.scatter, "where.self": torch.where, "where.ScalarSelf": torch.where,
    "where.ScalarOther": torch.where, "masked_fill.Scalar": torch.masked_fill,
    "ones.default": torch.ones, "zeros.default": torch.zeros, "full.default": torch.full,
    "arange.default": torch.arange, "arange.start": torch.arange, "scalar_tensor.default": torch.scalar_tensor,
    "empty.memory_format": torch.empty,
    "mul.Tensor": torch.mul, "mul.Scalar": torch.mul, "add.Tensor": torch.add, "sub.Tensor": torch.sub,
    "div.Tensor": torch.div, "neg.default": torch.neg, "pow.Tensor_Scalar": torch.pow, "sqrt.default": torch.sqrt,
    "rsqrt.default": torch.rsqrt, "exp.default": torch.exp, "log.default": torch.log, "cos.default": torch.cos,
    "sin.default": torch.sin, "sigmoid.default": torch.sigmoid, "silu.default": torch._C._nn.silu,
    "logical_not.default": torch.logical_not, "bitwise_not.default": torch.bitwise_not,
    "bitwise_and.Tensor": torch.bitwise_and, "bitwise_or.Tensor": torch.bitwise_or, "eq.Scalar": torch.eq,
    "le.Tensor": torch.le, "lt.Scalar": torch.lt, "gt.Scalar": torch.gt, "ge.Scalar": torch.ge,
    "sum.dim_IntList": torch.sum, "amax.default": torch.amax, "bmm.default": torch.bmm, "mm.default": torch.mm,
    "native_layer_norm.default": torch.native_layer_norm, "_safe_softmax.default": torch._safe_softmax,
    "_softmax.default": torch._softmax, "topk.default": torch.topk, "sort.default": torch.sort,
}


def aten_callable(op: str, overload: str) -> Callable[..., Any]:
    """The fastest callable for `torch.ops.aten.<op>.<overload>`: its Python binding (PYTHON_BINDINGS), else the
    overload's C++ callable."""
    return PYTHON_BINDINGS.get(f"{op}.{overload}") or getattr(getattr(torch.ops.aten, op), overload)._op


class TracedBinder:
    """The torch.ops overloads themselves (module docstring)."""

    def fused(self, op_name: str) -> Callable[..., Any]:
        return getattr(torch.ops.ascend_dsa, op_name).default

    def aten(self, op: str, overload: str) -> Callable[..., Any]:
        return getattr(getattr(torch.ops.aten, op), overload)

    def native(self, kernel: str, op: str, overload: str) -> Callable[..., Any]:
        return self.aten(op, overload)

    def extern(self, op: str) -> Callable[..., Any]:
        """Inductor's `extern_kernels.<op>` (torch.mm, torch.bmm, torch.addmm, called with out=)."""
        return getattr(torch, op)

    def functionalized(self) -> Callable[..., Any]:
        """torch's auto_functionalized_v2 higher-order op."""
        return functionalized.HOP


class DirectBinder(TracedBinder):
    """What runs (module docstring); the overloads where there is nothing more direct."""

    def fused(self, op_name: str) -> Callable[..., Any]:
        return implementation(op_name) or super().fused(op_name)

    def aten(self, op: str, overload: str) -> Callable[..., Any]:
        return serial_when_small(f"{op}.{overload}", aten_callable(op, overload))

    def native(self, kernel: str, op: str, overload: str) -> Callable[..., Any]:
        return NATIVE_MODULES[kernel].native_callable() or super().native(kernel, op, overload)

    def extern(self, op: str) -> Callable[..., Any]:
        """mm: the native skinny product into out where it applies; bmm and addmm on one thread when small."""
        if op == "mm":
            return skinny_mm.native_out_callable()
        return serial_when_small(f"{op}.default", super().extern(op))

    def functionalized(self) -> Callable[..., Any]:
        """The op's own call where nothing is copied (npu_graph.runtime.functionalized)."""
        return functionalized.call


DIRECT, AS_TRACED = DirectBinder(), TracedBinder()

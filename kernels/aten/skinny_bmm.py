"""Decode-sized batched products in the CPU runtime: aten.bmm of [B, M, K] by [B, K, N] with a few rows (M) per
batch, B independent products, as MLA's absorbed attention makes them at decode (each head's query row times
its slice of the key-value projection, and the attention output times the value slice).

Like aten.mm's products (kernels/aten/skinny_mm.py), their time is reading the weights: the runtime binds the
generated source's `torch.ops.aten.bmm.default(...)` calls to `bmm` (npu_graph.targets.cpu_bindings), which takes
native/skinny_mm.c's bf16 product (kernels/aten/skinny_bf16.py: the output columns of all batches split across
the threads, each weight slice read in whichever of its two layouts has unit stride) where it applies and
kernels/native/dispatch.py measured it faster for the shape class, else aten.bmm; decided once per signature.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from npu_graph.kernels.aten import skinny_bf16, skinny_mm
from npu_graph.kernels.native import call_plans
from npu_graph.kernels.native import loader as native
from npu_graph.runtime.serial_calls import serial_when_small

NATIVE_SOURCE = skinny_bf16.NATIVE_SOURCE
_aten_bmm = serial_when_small("bmm.default", torch.bmm)     # what aten.bmm is bound to without the native kernel
_PLANS = call_plans.Plans("skinny_bmm")


def _torch_bmm(x: Tensor, w: Tensor) -> Tensor:
    return _aten_bmm(x, w)


def bmm(x: Tensor, w: Tensor) -> Tensor:
    """x @ w for x [B, M, K] and w [B, K, N], through the native kernel where it applies and was measured faster
    (module docstring), else aten.bmm."""
    signature = skinny_mm.call_signature(x, w)
    plan = _PLANS.get(signature)
    if plan is not None:
        return plan(x, w)
    if not (x.dim() == 3 and native.load(NATIVE_SOURCE) and skinny_bf16.takes(x, w)):
        _PLANS.put(signature, _torch_bmm)
        return _aten_bmm(x, w)
    return skinny_mm.bf16_product("skinny_bmm", _PLANS, signature, x, w, _torch_bmm)


def native_callable() -> Callable[..., Any] | None:
    """What the CPU runtime binds aten.bmm calls to (runtime.direct_calls): `bmm`, or None when the native library
    is not loaded (or ASCEND_DSA_NATIVE=0 when the graph is loaded)."""
    return native.native_entry(NATIVE_SOURCE, lambda lib: bmm)

"""Depthwise 1-D convolutions (linear-attention short convolutions) in the CPU runtime.

KDA / Mamba / GDN layers run a causal depthwise convolution (kernel 3-4) over [B, C, T], usually a transposed
view of the [B, T, C] projections (channel stride 1). aten.convolution sends it to oneDNN through a copy to
[B, C, T] and a 2-D convolution with one group per channel, where the math is K multiply-adds per output.
native/depthwise_conv1d.c reads the operands in place and writes the output aten would write. Measured on this
project's 2-core CPU (K=4, padding 3, channels-last input, median, noisy): 192 ch x 2048 steps 2.2 ms -> 80 us,
4096 x 2048 68 ms -> 4.7 ms, 4096 x 64 520 -> 205 us; a decode step (192 x 4 -> 1 step) 57 us -> 11 us, against
~30 us for passes/short_depthwise_conv's shifted multiply-adds.

When the runtime builds a CompiledGraph it binds the generated source's `torch.ops.aten.convolution.default(...)`
calls to what `conv1d` runs (`bind`, as skinny_mm binds aten.mm; the stored source and the cache keep the aten form;
ASCEND_DSA_NATIVE=0 is read then). `conv1d` takes the native kernel for fp32 CPU operands x [B, C, T] (any
strides), weight [C, 1, K] and bias [C] or None, with groups == C, stride 1, dilation 1, padding p >= 0, not
transposed, B, C, T, K >= 1, at least one output step and no autograd; everything else (and every convolution
when the native library is not built or ASCEND_DSA_NATIVE=0) goes to aten.convolution unchanged, errors
included. The output has the strides aten's output has (`_output`: the graph after it may view it by them).
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from npu_graph.kernels.native import dispatch
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import prototypes as native_prototypes

NATIVE_SOURCE = "depthwise_conv1d"
NAME = "_ascend_dsa_depthwise_conv1d"
_CALL = "torch.ops.aten.convolution.default("
_aten_conv = torch.ops.aten.convolution.default
_F32 = torch.float32


@functools.cache
def _typed(lib: ctypes.CDLL) -> Callable[..., None]:
    return native_prototypes.typed(lib, NATIVE_SOURCE, "dwc_conv1d")


def _takes(x: Tensor, w: Tensor, bias: Tensor | None, stride: Sequence[int], padding: Sequence[int],
           dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int) -> bool:
    """Whether the native kernel computes this convolution (module docstring)."""
    if not (x.dtype is _F32 and w.dtype is _F32 and x.dim() == 3 and w.dim() == 3 and x.is_cpu and w.is_cpu
            and x.layout is torch.strided and w.layout is torch.strided and not transposed):
        return False
    batch, channels, steps = x.shape
    if (list(stride), list(dilation), list(output_padding), len(padding)) != ([1], [1], [0], 1):
        return False
    if (groups != channels or tuple(w.shape[:2]) != (channels, 1) or min(batch, channels, steps, w.shape[2]) < 1
            or padding[0] < 0 or steps + 2 * padding[0] < w.shape[2]):
        return False
    if bias is not None and not (bias.dtype is _F32 and bias.is_cpu and bias.layout is torch.strided
                                 and tuple(bias.shape) == (channels,)):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad
                                             or (bias is not None and bias.requires_grad)))


def _strides_like_channels_last(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether c10 reads 4-D sizes/strides as channels-last (Tensor.suggest_memory_format): the strides grow
    in the order C, W, H, N, each at least the extent of the previous one, ambiguous cases being contiguous."""
    if strides[1] == 0:
        return False
    least = 0
    for d in (1, 3, 2, 0):
        if sizes[d] == 0 or strides[d] < least or (d == 0 and least == strides[1]):
            return False
        least = strides[d] * max(sizes[d], 1)
    return True


def _output(x: Tensor, w: Tensor, steps: int) -> Tensor:
    """An uninitialised output with the strides aten.convolution gives: it runs a 1-D convolution as a 2-D one
    over x.contiguous().unsqueeze(2) and w.unsqueeze(2), with a channels-last output when either suggests
    channels-last (in practice: x [B, C, 1] with channel stride 1), then squeezes the output back to 3-D."""
    batch, channels, length = x.shape
    sxb, sxc, sxt = x.stride() if x.is_contiguous() else (channels * length, length, 1)
    swc, sw1, swk = w.stride()
    channels_last = (_strides_like_channels_last((batch, channels, 1, length), (sxb, sxc, length * sxt, sxt))
                     or _strides_like_channels_last((channels, 1, 1, w.shape[2]), (swc, sw1, w.shape[2] * swk, swk)))
    strides = (channels * steps, 1, channels) if channels_last else (channels * steps, steps, 1)
    return torch.empty_strided((batch, channels, steps), strides, dtype=_F32, device="cpu")


def _native_conv(kernel: Callable[..., None], x: Tensor, w: Tensor, bias: Tensor | None, stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
                 groups: int) -> Tensor:
    """aten.convolution through the native kernel where it applies and kernels/native/dispatch.py measured it faster,
    else aten.convolution."""
    def aten() -> Tensor:
        return _aten_conv(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)

    if not _takes(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
        return aten()
    cls = dispatch.shape_class(*x.shape, x.stride(1) == 1, w.shape[2], padding[0], bias is not None)
    return dispatch.run("depthwise_conv1d", NATIVE_SOURCE, cls, lambda: _run_native(kernel, x, w, bias, padding),
                        aten)


def _run_native(kernel: Callable[..., None], x: Tensor, w: Tensor, bias: Tensor | None,
                padding: Sequence[int]) -> Tensor:
    pad, taps = padding[0], w.shape[2]
    steps = x.shape[2] + 2 * pad - taps + 1
    out = _output(x, w, steps)
    kernel(x.data_ptr(), *x.shape, *x.stride(), w.data_ptr(), w.stride(0), w.stride(2), taps,
           None if bias is None else bias.data_ptr(), 0 if bias is None else bias.stride(0), pad,
           out.data_ptr(), steps, *out.stride())
    return out


def conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int], padding: Sequence[int],
           dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int) -> Tensor:
    """aten.convolution.default(...) with its argument list, through the native depthwise kernel where it
    applies (module docstring), else aten.convolution."""
    loaded = native.load(NATIVE_SOURCE)
    if not loaded:
        return _aten_conv(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    return _native_conv(_typed(loaded.lib), x, weight, bias, stride, padding, dilation, transposed,
                        output_padding, groups)


def native_callable() -> Callable[..., Any] | None:
    """What the CPU runtime binds this kernel's ATen calls to (runtime.direct_calls): the native entry, or None
    when the native library is not loaded (or ASCEND_DSA_NATIVE=0 when the graph is loaded)."""
    return native.native_entry(NATIVE_SOURCE, lambda lib: functools.partial(_native_conv, _typed(lib)))

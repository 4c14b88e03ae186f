"""Native router selection for `ascend_dsa::moe_gating_top_k` at decode (kernels/native/moe_gating.c, built at
first use by kernels/native/loader.py).

For a few tokens the torch path is ~15 small tensor operations (group scores, group top-k, mask, top-k, gather,
renormalisation), ~90 us a call and 2-3x that between a decode step's memory-bound layers; the C selection
takes a few microseconds. The normalised scores are computed by the caller in torch (so that the op's third
output is the torch path's, bit for bit); the kernel does the rest with the same fp32 operations. `planned`
returns None when the library is not loaded (no compiler, ASCEND_DSA_NATIVE=0), when the router is larger
than a decode-sized one or its scores are not contiguous, and its plan returns None when a score is not finite
(the torch path orders NaN as torch.topk does).
"""
import ctypes
import functools
from collections.abc import Callable

import torch
from torch import Tensor

from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import prototypes as native_prototypes

NATIVE_SOURCE = "moe_gating"
MAX_SCORES = 1 << 16          # rows x experts above which the vectorised torch path is used


@functools.cache
def _typed(lib: ctypes.CDLL) -> ctypes._CFuncPtr:
    return native_prototypes.typed(lib, NATIVE_SOURCE, "mg_select")


def takes_shape(x: torch.Tensor) -> bool:
    """Whether the native selection is loaded and takes a router of x's size (decode-sized, on the CPU)."""
    return x.numel() <= MAX_SCORES and x.is_cpu and bool(native.load(NATIVE_SOURCE))


def planned(norm: Tensor, k: int, k_group: int, group_count: int, group_select_mode: int, renorm: bool, eps: float,
            scale: float) -> Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor] | None] | None:
    """The native selection for scores of norm's signature (kernels/native/call_plans keeps it per signature): a plan
    returning (y fp32 [T, k], expert_idx int32 [T, k]) from the normalised scores norm fp32 [T, E] and the bias,
    with the router's options and sizes fixed and the bias converted to contiguous fp32 only where it is not; None
    when the kernel does not take such scores (module docstring)."""
    if not (takes_shape(norm) and norm.is_contiguous()):
        return None
    entry, (rows, experts) = _typed(native.load(NATIVE_SOURCE).lib), norm.shape

    def plan(norm: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor] | None:
        if bias is not None and not (bias.dtype is torch.float32 and bias.is_contiguous()):
            bias = bias.to(torch.float32).contiguous()
        y = torch.empty(rows, k, dtype=torch.float32)
        idx = torch.empty(rows, k, dtype=torch.int32)
        status = entry(norm.data_ptr(), None if bias is None else bias.data_ptr(), rows, experts, k, k_group,
                       group_count, group_select_mode, int(renorm), eps, scale, y.data_ptr(), idx.data_ptr())
        return (y, idx) if status == 0 else None

    return plan

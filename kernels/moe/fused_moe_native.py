"""Native token-by-token `ascend_dsa::fused_moe` (kernels/native/fused_moe.c, built at first use by
kernels/native/loader.py).

At decode the op routes one token to its k experts. The torch path makes ~8 calls per expert (two products, a
chunk, silu, two multiplications, an add) plus the routing lists; on a tiny model's experts that is ~150 us of
calls around a few microseconds of arithmetic. The kernel does the token's experts in one call, in the torch
path's order (by expert id), fp32; several tokens (a short prompt) in one call too, each as one token, shared by
the threads when there is enough work (the grouped torch path wins once the experts' products are large).
kernels/native/dispatch.py takes it where it measured it faster for the shape class, and a plan per signature
(kernels/native/call_plans) keeps the decision and the sizes.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch
from torch import Tensor

from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import prototypes as native_prototypes

NATIVE_SOURCE = "fused_moe"
_F32 = torch.float32


@functools.cache
def _typed(lib: ctypes.CDLL) -> tuple[Callable[..., int], Callable[..., int]]:
    return (native_prototypes.typed(lib, NATIVE_SOURCE, "fm_token"),
            native_prototypes.typed(lib, NATIVE_SOURCE, "fm_tokens"))


def takes(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> bool:
    """Whether the kernel reads these operands: fp32 tokens, fp32 experts stored contiguously, fp32 routing
    weights and int64 ids (contiguous), all on the CPU, no autograd."""
    return (x.dtype is _F32 and w13.dtype is _F32 and w2.dtype is _F32
            and topk_weights.dtype is _F32 and topk_ids.dtype is torch.int64
            and x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()
            and topk_weights.is_contiguous() and topk_ids.is_contiguous()
            and x.is_cpu and w13.is_cpu and w2.is_cpu and topk_weights.is_cpu and topk_ids.is_cpu
            and not ((x.requires_grad or w13.requires_grad or w2.requires_grad) and torch.is_grad_enabled()))


def kernel() -> Callable[..., int] | None:
    """The one-token native entry when the library is loaded, else None."""
    loaded = native.load(NATIVE_SOURCE)
    return _typed(loaded.lib)[0] if loaded else None


def plan(x: Tensor, w13: Tensor, w2: Tensor, topk_ids: Tensor,
         id_error: Callable[[Tensor], None]) -> Callable[..., Tensor]:
    """The kernel for calls of these operands' signature (`takes` holds and the library is loaded): sizes fixed,
    one output allocation. `id_error(topk_ids)` raises the op's error for ids outside [0, E) (the kernel reports
    them and computes nothing)."""
    one, several = _typed(native.load(NATIVE_SOURCE).lib)
    tokens, hidden, experts, inter, k = x.shape[0], x.shape[1], w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]

    def run(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        out = torch.empty(tokens, hidden, dtype=_F32)
        if tokens == 1:
            status = one(x.data_ptr(), hidden, w13.data_ptr(), w2.data_ptr(), experts, inter, topk_ids.data_ptr(),
                         topk_weights.data_ptr(), k, out.data_ptr())
        else:
            status = several(x.data_ptr(), tokens, hidden, hidden, w13.data_ptr(), w2.data_ptr(), experts, inter,
                             topk_ids.data_ptr(), topk_weights.data_ptr(), k, torch.get_num_threads(), out.data_ptr())
        if status:
            if status > 0:
                id_error(topk_ids)
            raise MemoryError(f"ascend_dsa::fused_moe: the native kernel could not allocate {inter} values")
        return out

    return run

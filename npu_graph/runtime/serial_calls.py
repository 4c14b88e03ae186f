"""Small calls of the ATen ops that split tiny work across threads run on the calling thread alone.

ATen's CPU kernels for bmm, softmax, layer norm, index_select, topk and sort parallelize over their batch or
outer rows with a grain of about one, and BLAS threads small mm / addmm products, so a decode-sized call
([4, 1, 32] @ [4, 32, 16]) wakes the whole OpenMP team. On an idle machine that costs microseconds; when another
process holds a core it costs a scheduler time slice: the team's barrier waits for a thread that is not running
(measured on the 2-core VM with one core busy: a [4, 1, 32] @ [4, 32, 16] bmm 8–16 ms instead of 5 µs, a decode
step of the tiny deepseek_v32 model 180 ms instead of 6 ms). Below a size where one thread does the work in a few
microseconds (`SMALL_ELEMENTS`, ATen's own grain under which elementwise ops never fork; `SMALL_MACS` for
products), the runtime calls these ops with one intra-op thread. It is the same kernel, so the results are
identical; the thread count is restored at once.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

SMALL_ELEMENTS = 32768          # at::internal::GRAIN_SIZE
SMALL_MACS = 1 << 18            # ~20-40 µs of one core's multiply-adds


def _first_elements(args: tuple[Any, ...]) -> int:
    return args[0].numel()


def _product_macs(args: tuple[Any, ...]) -> int:
    return math.prod(args[0].shape) * args[1].shape[-1]     # ([B,] M, K) @ ([B,] K, N): [B·]M·K·N


# MKL multiplies a single row by a matrix on the calling thread at these sizes: on the 2-core EPYC VM with the
# other core busy, [1, 64..512] @ [64..512, 64..1024] took the same time with one intra-op thread as with two. Such
# products are called as they are: switching the thread count costs ~1.4 µs, about half of a decode-sized product.
_ONE_ROW_ON_CALLER = torch.backends.mkl.is_available()


def _mm_macs(args: tuple[Any, ...]) -> int:
    """[M, K] @ [K, N]: M·K·N, or 0 (nothing that forks) for one row under MKL."""
    return 0 if _ONE_ROW_ON_CALLER and args[0].shape[0] == 1 else _product_macs(args)


def _addmm_macs(args: tuple[Any, ...]) -> int:
    return _mm_macs(args[1:])                                # bias + [M, K] @ [K, N]


# overload -> (its work as the runtime's sizes rule measures it, the largest work run on one thread)
SERIAL_WHEN_SMALL: dict[str, tuple[Callable[[tuple[Any, ...]], int], int]] = {
    "bmm.default": (_product_macs, SMALL_MACS),
    "mm.default": (_mm_macs, SMALL_MACS),
    "addmm.default": (_addmm_macs, SMALL_MACS),
    "native_layer_norm.default": (_first_elements, SMALL_ELEMENTS),
    "_softmax.default": (_first_elements, SMALL_ELEMENTS),
    "_safe_softmax.default": (_first_elements, SMALL_ELEMENTS),
    "_log_softmax.default": (_first_elements, SMALL_ELEMENTS),
    "index_select.default": (_first_elements, SMALL_ELEMENTS),
    "topk.default": (_first_elements, SMALL_ELEMENTS),
    "sort.default": (_first_elements, SMALL_ELEMENTS),
}


def serial_when_small(overload: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (the callable of aten `overload`, e.g. "bmm.default"), called with one intra-op thread when the call is
    small (module docstring); `fn` itself for overloads that are not in SERIAL_WHEN_SMALL."""
    rule = SERIAL_WHEN_SMALL.get(overload)
    if rule is None:
        return fn
    work, limit = rule

    def call(*args: Any, **kwargs: Any) -> Any:
        threads = torch.get_num_threads()
        if threads == 1 or not 0 < work(args) <= limit:     # 0: no work that forks
            return fn(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return call

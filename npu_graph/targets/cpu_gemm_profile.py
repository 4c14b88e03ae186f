"""Which weight form the CPU GEMM is fastest with, and the measurement that decides it.

A linear layer reaches ATen as `mm(x, t(w))`: the weight [N, K] read through a transposed view ("NT"). The
other forms measured: the weight pre-transposed once into a contiguous [K, N] ("NN"), and each of them with
the weight and activation in bf16. `measure` times them side by side; `ascend-dsa bench quant` prints that
table. On the development machine (2 shared cores, AVX512-BF16, no AMX; noisy) it read, in µs per call:

    M=1     1024x256: NT 28.9  NN 20.4 | 576x512: NT 26.2  NN 23.5 | 8192x512 (lm_head): NT 1640  NN 397
    M=64    1024x512: NT 503   NN 512  | 512x1024: NT 443  NN 407  | 8192x512: NT 4645 NN 4367
    bf16 is about 2x faster than fp32 for M >= 4 in either form (half the bytes, native dot products).

So the CPU target pre-transposes every frozen 2-D matmul weight (decode, M=1, gains up to 4x on wide weights;
prefill is even), and keeps its dtype: fp32 -> bf16 would be faster but changes the numbers (the layout pass
never does), and bf16 weights are already in the faster dtype.

Except large bf16 weights: read through the transposed view, a one-row bf16 product streams each output's
contiguous weight row with the CPU's bf16 dot products, and runs near the streaming bandwidth; the pre-transposed
form reads the same bytes a third slower. At DeepSeek-V3.2's sizes (same machine, quiet, µs per call, M=1, bf16):

    7168x16384 (o_proj): NT 11023 NN 15456 | 32768x1536: NT 4852 NN 7383 | 4096x7168: NT 2572 NN 4169
    8192x512: NT 203 NN 314 | 4096x1024: NT 208 NN 308 | 576x512: NT 30 NN 28 | 1024x256: NT 32 NN 26
    M=64 7168x2048: NT 5005 NN 5763 (fp32 at these sizes: NN as fast or faster)

so a bf16 weight of BF16_KEEP_BYTES or more keeps its [N, K] form (which also leaves it out of
fuse_sibling_matmuls' concatenated products: one NT product per weight is faster than one NN product of them all).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from npu_graph.pass_api import PRE_TRANSPOSED

BF16_KEEP_BYTES = 2 << 20       # past the per-core L2 of the CPUs measured: the streamed rows win


def preferred_form(dtype: torch.dtype, shape: tuple[int, ...]) -> str | None:
    """The CPU form of a matmul weight of `dtype` and `shape` [N, K], or None to keep it as it is."""
    if len(shape) != 2 or dtype not in (torch.float32, torch.bfloat16):
        return None
    if dtype is torch.bfloat16 and shape[0] * shape[1] * 2 >= BF16_KEEP_BYTES:
        return None
    return PRE_TRANSPOSED


def _best_us(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best * 1e6


def measure(shapes: list[tuple[int, int, int]], repeat: int = 50) -> list[dict[str, object]]:
    """µs per call of x[M, K] @ W for each (M, N, K): NT / NN forms, fp32 and bf16, timed side by side."""
    rows = []
    generator = torch.Generator().manual_seed(0)
    for m, n, k in shapes:
        x, w = torch.randn(m, k, generator=generator), torch.randn(n, k, generator=generator)
        row: dict[str, object] = {"case": f"M={m} {n}x{k}"}
        for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            xd, wd = x.to(dtype), w.to(dtype)
            wt = wd.t().contiguous()
            row[f"{tag}_nt_us"] = _best_us(lambda xd=xd, wd=wd: torch.mm(xd, wd.t()), repeat)
            row[f"{tag}_nn_us"] = _best_us(lambda xd=xd, wt=wt: torch.mm(xd, wt), repeat)
        row["nn_speedup_fp32"] = row["fp32_nt_us"] / row["fp32_nn_us"]
        rows.append(row)
    return rows

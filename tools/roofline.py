"""The machine's two roofline rates, measured in the run that uses them: a streaming read (bytes/s) and a large
GEMM (flops/s), both on every thread torch uses, best of a few tries (the ceiling this machine reached, not its
average: a floor must be one the machine can be seen to reach)."""
from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from npu_graph.tools.context_costs import Rates

READ_BYTES = 512 << 20       # far past any last-level cache
GEMM_SIZE = 2048
GEMM_START = 256
GEMM_BUDGET_S = 1.0      # the longest one product of the GEMM probe may take


def _best_seconds(fn: Callable[[], object], tries: int) -> float:
    fn()
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(num_bytes: int = READ_BYTES, tries: int = 5) -> float:
    """Bytes/s of a sum over an fp32 tensor of `num_bytes` (every byte read once, vectorised, all threads)."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / _best_seconds(data.sum, tries)


def gemm_rate(dtype: torch.dtype, size: int = GEMM_SIZE, tries: int = 3, budget_s: float = GEMM_BUDGET_S) -> float:
    """Flops/s of a `size`-cubed matrix product in `dtype`: measured on the largest power-of-two size up to `size`
    whose single product takes under `budget_s` (a CPU without native bf16 products runs torch's at under a
    GFLOP/s, where one 2048-cubed product takes half a minute; the rate a smaller one shows is the same)."""
    generator = torch.Generator().manual_seed(0)
    n = min(GEMM_START, size)
    while True:
        a = torch.randn(n, n, generator=generator).to(dtype)
        b = torch.randn(n, n, generator=generator).to(dtype)
        start = time.perf_counter()
        a @ b
        took = time.perf_counter() - start
        if n >= size or took * 8 > budget_s:
            return 2.0 * n ** 3 / _best_seconds(functools.partial(torch.matmul, a, b), tries)
        n *= 2


def measure(dtype: torch.dtype = torch.bfloat16, small: bool = False) -> tuple[Rates, dict[str, float]]:
    """(the rates a floor uses: read bandwidth and the faster of the fp32 and `dtype` GEMM rates, every figure
    measured); `small` measures on small sizes, for tests."""
    num_bytes, size = (8 << 20, 256) if small else (READ_BYTES, GEMM_SIZE)
    figures = {"read_bytes_per_s": read_bandwidth(num_bytes),
               "gemm_fp32_flops_per_s": gemm_rate(torch.float32, size),
               f"gemm_{str(dtype).removeprefix('torch.')}_flops_per_s": gemm_rate(dtype, size)}
    rates = Rates(bandwidth=figures["read_bytes_per_s"],
                  gemm_rate=max(v for k, v in figures.items() if k.startswith("gemm")))
    return rates, figures

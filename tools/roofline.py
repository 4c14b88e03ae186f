"""The machine's two roofline rates, measured in the run that uses them: a streaming read (bytes/s) and a large
GEMM (flops/s), both on every thread torch uses, best of a few tries (the ceiling this machine reached, not its
average: a floor must be one the machine can be seen to reach)."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from npu_graph.tools.context_costs import Rates

READ_BYTES = 512 << 20       # far past any last-level cache
GEMM_SIZE = 2048


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


def gemm_rate(dtype: torch.dtype, size: int = GEMM_SIZE, tries: int = 3) -> float:
    """Flops/s of a `size`-cubed matrix product in `dtype`."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    return 2.0 * size ** 3 / _best_seconds(lambda: a @ b, tries)


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

"""Side-by-side timing for benchmarks: candidates run alternately in one process, medians reported,
so that a noisy shared machine shifts every candidate alike."""
import statistics
import time
from collections.abc import Callable


def balanced_orders(n: int) -> list[list[int]]:
    """Round orders of n candidates in which every candidate directly follows every other one equally often
    (a Williams design: n rounds for even n, 2n for odd n). What ran just before a candidate decides how warm
    its caches are; a fixed cyclic order would give each candidate the same predecessor in almost every round."""
    first = [0]
    for i in range(1, n):
        first.append((i + 1) // 2 if i % 2 else n - i // 2)
    rows = [[(x + shift) % n for x in first] for shift in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def time_side_by_side(candidates: dict[str, Callable[[], object]], repeat: int = 15,
                      warmup: int = 3) -> dict[str, float]:
    """Median wall time in seconds of each candidate, candidates interleaved round by round in the orders of
    `balanced_orders`, so that each one follows every other equally often (`repeat` is rounded up to whole
    cycles of those orders)."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    names = list(candidates)
    orders = balanced_orders(len(names))
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(-(-repeat // len(orders)) * len(orders)):
        for index in orders[round_ % len(orders)]:
            start = time.perf_counter()
            candidates[names[index]]()
            samples[names[index]].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in samples.items()}

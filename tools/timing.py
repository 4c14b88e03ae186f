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
                      warmup: int = 3, slow_s: float | None = None) -> dict[str, float]:
    """Median wall time in seconds of each candidate, candidates interleaved round by round in the orders of
    `balanced_orders`, so that each one follows every other equally often (`repeat` is rounded up to whole
    cycles of those orders). With `slow_s`, a candidate whose last warmup call took at least `slow_s` seconds is
    not run again: that call is its one sample (a call that long is timed well enough once, and repeating it
    would make the whole comparison take many times as long); the others alternate as usual."""
    last: dict[str, float] = {}
    for _ in range(warmup):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            last[name] = time.perf_counter() - start
    slow = {name: t for name, t in last.items() if slow_s is not None and t >= slow_s}
    names = [name for name in candidates if name not in slow]
    orders = balanced_orders(len(names)) if names else []
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(-(-repeat // len(orders)) * len(orders) if orders else 0):
        for index in orders[round_ % len(orders)]:
            start = time.perf_counter()
            candidates[names[index]]()
            samples[names[index]].append(time.perf_counter() - start)
    medians = {name: statistics.median(ts) for name, ts in samples.items()}
    return {name: medians[name] if name in medians else slow[name] for name in candidates}

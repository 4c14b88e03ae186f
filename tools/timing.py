"""Side-by-side timing for benchmarks: candidates run alternately in one process, medians reported,
so that a noisy shared machine shifts every candidate alike."""
import statistics
import time
from collections.abc import Callable


def time_side_by_side(candidates: dict[str, Callable[[], object]], repeat: int = 15,
                      warmup: int = 3) -> dict[str, float]:
    """Median wall time in seconds of each candidate, candidates interleaved round by round. Each round
    starts one candidate further along, so every candidate follows every other equally often (a candidate
    that always ran after the one that evicts the caches would pay for it in every round)."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    names = list(candidates)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeat):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            start = time.perf_counter()
            candidates[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in samples.items()}

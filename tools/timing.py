"""Side-by-side timing for benchmarks: candidates run alternately in one process, medians reported,
so that a noisy shared machine shifts every candidate alike."""
import statistics
import time
from collections.abc import Callable


def time_side_by_side(candidates: dict[str, Callable[[], object]], repeat: int = 15,
                      warmup: int = 3) -> dict[str, float]:
    """Median wall time in seconds of each candidate, candidates interleaved round by round."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeat):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in samples.items()}

"""A measured choice between equivalent callables, made on the first call (the max-autotune modes).

`MeasuredChoice(name, candidates, bind)` is called in place of the candidates. Its first call runs every
candidate on that call's own arguments: one warm-up round (a lazily compiled candidate, such as a
torch.compile'd SuperKernel region, compiles there), then timed rounds in alternating order until ROUNDS or
BUDGET_S. It keeps the fastest (minimum time), hands it to `bind` so later calls reach it directly, and returns
its result. A candidate that raises is dropped with one warning naming it; the first candidate is the
reference, so its errors propagate. Candidates must compute the same results without side effects.
"""
from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

log = logging.getLogger("npu_graph")
ROUNDS = 5
BUDGET_S = 0.5


class MeasuredChoice:
    """Times `candidates` on the first call and binds the fastest (module docstring)."""

    def __init__(self, name: str, candidates: dict[str, Callable[..., Any]],
                 bind: Callable[[Callable[..., Any]], None]):
        self.name, self.candidates, self.bind = name, dict(candidates), bind
        self.choice: str | None = None
        self.times_ms: dict[str, float] = {}

    def _warm_up(self, args: tuple[Any, ...]) -> dict[str, Callable[..., Any]]:
        usable = {}
        for index, (label, fn) in enumerate(self.candidates.items()):
            try:
                fn(*args)
            except Exception as exc:
                if index == 0:
                    raise
                warnings.warn(f"ascend_dsa: {self.name}: the {label} candidate failed ({type(exc).__name__}: "
                              f"{exc}); it is not used", RuntimeWarning, stacklevel=3)
                continue
            usable[label] = fn
        return usable

    def __call__(self, *args: Any) -> Any:
        usable = self._warm_up(args)
        best = {label: float("inf") for label in usable}
        results: dict[str, Any] = {}
        start = time.perf_counter()
        for round_ in range(ROUNDS):
            order = list(usable.items()) if round_ % 2 == 0 else list(reversed(usable.items()))
            for label, fn in order:
                t0 = time.perf_counter()
                results[label] = fn(*args)
                best[label] = min(best[label], time.perf_counter() - t0)
            if time.perf_counter() - start > BUDGET_S:
                break
        self.choice = min(best, key=best.__getitem__)
        self.times_ms = {label: seconds * 1e3 for label, seconds in best.items()}
        log.info("ascend_dsa: %s: %s -> %s", self.name,
                 ", ".join(f"{label} {ms:.4g} ms" for label, ms in self.times_ms.items()), self.choice)
        self.bind(usable[self.choice])
        return results[self.choice]

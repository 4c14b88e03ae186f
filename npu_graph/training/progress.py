"""A training run's progress on stderr: a rich progress bar with the loss and tokens/s on a terminal, a plain
line every LINE_EVERY_S seconds otherwise (logs, CI)."""
from __future__ import annotations

import sys
import time
from typing import Any

LINE_EVERY_S = 30.0


class StepReporter:
    """`update(step, losses, tokens)` after each step; a context manager that closes the bar."""

    def __init__(self, max_steps: int | None, budget_s: float, enabled: bool = True):
        self.max_steps, self.budget_s, self.enabled = max_steps, budget_s, enabled
        self._bar: Any = None
        self._task: Any = None
        self._start = self._last_line = time.perf_counter()
        self._tokens = 0

    def __enter__(self) -> StepReporter:
        if self.enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("training"), BarColumn(), TextColumn("{task.description}"),
                                 TimeElapsedColumn(), console=Console(stderr=True))
            self._bar.start()
            total = self.max_steps if self.max_steps is not None else self.budget_s
            self._task = self._bar.add_task("", total=total)
        return self

    def update(self, step: int, losses: dict[str, float], tokens: int) -> None:
        self._tokens += tokens
        elapsed = time.perf_counter() - self._start
        mtp = f"(MTP {losses['mtp_bits_per_byte']:.3f})  " if "mtp_bits_per_byte" in losses else ""
        text = (f"step {step}  {losses['bits_per_byte']:.3f} bits/byte  {mtp}"
                f"{self._tokens / max(elapsed, 1e-9):,.0f} tokens/s")
        if self._bar is not None:
            done = step if self.max_steps is not None else min(elapsed, self.budget_s)
            self._bar.update(self._task, completed=done, description=text)
        elif self.enabled and time.perf_counter() - self._last_line >= LINE_EVERY_S:
            print(f"ascend-dsa train: {text}", file=sys.stderr, flush=True)
            self._last_line = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

"""Progress of long work (native kernel builds, waits for another process's cache lock, benchmark cases, the
demo's steps), on stderr so that a command's stdout (`--json`) stays clean.

On a terminal a step shows a rich spinner while it runs and leaves one line with its duration; anywhere else (a
pipe, a log file, CI) it prints one plain line when it starts and one when it ends, so a log still says what the
process was doing. A step that raises reports no "done" line (the error is the caller's to report).
ASCEND_DSA_PROGRESS=0 silences it.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

ENV_SWITCH = "ASCEND_DSA_PROGRESS"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


@contextlib.contextmanager
def step(what: str, prefix: str = "ascend-dsa") -> Iterator[None]:
    """Show that `what` is running (module docstring)."""
    if not enabled():
        yield
        return
    from rich.console import Console  # here, not at import: the kernels import this module
    from rich.markup import escape

    out = Console(stderr=True, highlight=False)     # made per use, so a redirected stderr is honoured
    label = f"{prefix}: {escape(what)}"
    start = time.perf_counter()
    if out.is_terminal:
        with out.status(f"{label} ..."):
            yield
    else:
        out.print(f"{label} ...", soft_wrap=True)
        yield
    out.print(f"{label}: done in {time.perf_counter() - start:.1f} s", soft_wrap=True)


class Sweep:
    """A benchmark sweep of `total` points: `point(what)` runs one as a step, its label prefixed with
    "[done/total]"; on a terminal a bar of the whole sweep stays under the steps."""

    def __init__(self, total: int, prefix: str) -> None:
        self.total, self.prefix, self.done = total, prefix, 0
        self._bar = None

    def __enter__(self) -> Sweep:
        if enabled():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            out = Console(stderr=True, highlight=False)
            if out.is_terminal:
                self._bar = Progress("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                     console=out, transient=True)
                self._bar.start()
                self._task = self._bar.add_task(self.prefix, total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    @contextlib.contextmanager
    def point(self, what: str) -> Iterator[None]:
        """Run one point of the sweep (a step: its start and done lines), then advance the bar."""
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self.prefix}: {what}")
            start = time.perf_counter()
            yield
            self._bar.console.print(f"{self.prefix}: [{self.done + 1}/{self.total}] {what}: done in "
                                    f"{time.perf_counter() - start:.1f} s", soft_wrap=True, markup=False)
        else:
            with step(f"[{self.done + 1}/{self.total}] {what}", self.prefix):
                yield
        self.done += 1
        if self._bar is not None:
            self._bar.advance(self._task)

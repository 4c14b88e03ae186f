"""Progress of long command-line work, on stderr so that `--json` output on stdout stays clean JSON.

On a terminal each step shows a spinner with its elapsed time and leaves one line with its duration; anywhere
else (a pipe, a log file, CI) each step prints one plain line when it starts and one when it ends.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from rich.console import Console
from rich.markup import escape


def console() -> Console:
    """The stderr console progress is written to (made per use, so redirected stderr is honoured)."""
    return Console(stderr=True, highlight=False)


@contextlib.contextmanager
def step(what: str, prefix: str = "ascend-dsa") -> Iterator[None]:
    """Show that `what` is running; on success report how long it took (an error is left to the caller)."""
    out = console()
    label = f"{prefix}: {escape(what)}"
    start = time.perf_counter()
    if out.is_terminal:
        with out.status(f"{label} ..."):
            yield
    else:
        out.print(f"{label} ...", soft_wrap=True)
        yield
    out.print(f"{label}: done in {time.perf_counter() - start:.1f} s", soft_wrap=True)

"""Progress for long work (native kernel builds, benchmark cases, the demo's compile, waits for a lock), shown
on stderr so that a command's stdout (`--json`) stays clean.

On a terminal `status` is a rich spinner line that disappears when the work ends; otherwise (a pipe, CI logs)
it prints the message once as a plain line, so a log still says what the process was doing. Set
ASCEND_DSA_PROGRESS=0 to silence it.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

ENV_SWITCH = "ASCEND_DSA_PROGRESS"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


@contextlib.contextmanager
def status(message: str) -> Iterator[None]:
    """Show `message` while the body runs (module docstring)."""
    if not enabled():
        yield
        return
    if not sys.stderr.isatty():
        print(f"ascend-dsa: {message}", file=sys.stderr, flush=True)
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(message):
        yield

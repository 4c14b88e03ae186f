"""The native kernels' environment settings, read once per compiled-graph call.

ASCEND_DSA_NATIVE, ASCEND_DSA_CPU_ISA and ASCEND_DSA_NATIVE_CFLAGS are read at every op call made outside a
compiled graph, so they may be changed at any time. The CPU runtime reads them once per graph call
(`frozen()`): a tiny model's decode step makes ~250 of these lookups (~1 µs each on the project's VM), and a
change made while a graph runs takes effect at its next call.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

SWITCH = "ASCEND_DSA_NATIVE"
ISA = "ASCEND_DSA_CPU_ISA"
CFLAGS = "ASCEND_DSA_NATIVE_CFLAGS"     # extra compiler flags (e.g. sanitizers), part of the library's key
NAMES = (SWITCH, ISA, CFLAGS)
_THREAD = threading.local()


def get(name: str, default: str | None = None) -> str | None:
    """os.environ.get(name, default) for one of NAMES, as read when the innermost `frozen()` began."""
    values = getattr(_THREAD, "values", None)
    value = os.environ.get(name) if values is None else values[name]
    return default if value is None else value


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Inside, `get` on this thread returns the settings as they were on entry."""
    before = getattr(_THREAD, "values", None)
    _THREAD.values = {name: os.environ.get(name) for name in NAMES}
    try:
        yield
    finally:
        _THREAD.values = before

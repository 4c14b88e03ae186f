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
class _ThreadState(threading.local):
    values: dict[str, str | None] | None = None     # class defaults: a missing thread-local attribute costs an
    token: tuple[str | None, ...] | None = None     # exception inside getattr (~1.5 us)


_THREAD = _ThreadState()


def get(name: str, default: str | None = None) -> str | None:
    """os.environ.get(name, default) for one of NAMES, as read when the innermost `frozen()` began."""
    values = _THREAD.values
    value = os.environ.get(name) if values is None else values[name]
    return default if value is None else value


def token() -> tuple[str | None, ...]:
    """The values of NAMES as `get` reads them, as one hashable value (kernels/native/call_plans keys plans by it)."""
    values = _THREAD.token
    return tuple(map(os.environ.get, NAMES)) if values is None else values


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Inside, `get` and `token` on this thread return the settings as they were on entry."""
    before = _THREAD.values, _THREAD.token
    _THREAD.values = {name: os.environ.get(name) for name in NAMES}
    _THREAD.token = tuple(_THREAD.values.values())
    try:
        yield
    finally:
        _THREAD.values, _THREAD.token = before

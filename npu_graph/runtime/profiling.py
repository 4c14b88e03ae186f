"""torch.profiler events for the fused ops a compiled graph calls directly.

The CPU runtime binds each `torch.ops.ascend_dsa.<op>` call of the generated source to the op's Python
implementation (npu_graph.runtime.direct_calls), which skips the dispatcher and so the `ascend_dsa::<op>` event the
dispatcher records. ProfiledCalls puts it back without a per-call cost: the graph's namespace holds the plain
functions while no profiler runs, and functions that open a `record_function("ascend_dsa::<op>")` scope while
one does; `sync` (one flag read per graph call) switches between them. Which implementation ran is an event
inside it, recorded by kernels/native/dispatch.py: `ascend_dsa::<op>/native[LEVEL]` or `ascend_dsa::<op>/torch`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.autograd import profiler as autograd_profiler


def traced(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn inside a profiler scope named `label`."""
    def call(*args: Any, **kwargs: Any) -> Any:
        with autograd_profiler.record_function(label):
            return fn(*args, **kwargs)
    return call


class ProfiledCalls:
    """Switches the named functions of a namespace between their plain and traced forms (module docstring)."""

    def __init__(self, namespace: dict[str, Any], labels: dict[str, str]):
        self._namespace = namespace
        self._plain = {name: namespace[name] for name in labels}
        self._traced = {name: traced(label, namespace[name]) for name, label in labels.items()}
        self._on = False

    def sync(self) -> None:
        """Install the traced functions while a profiler records, the plain ones otherwise."""
        on = autograd_profiler._is_profiler_enabled
        if on is not self._on:
            self._namespace.update(self._traced if on else self._plain)
            self._on = on

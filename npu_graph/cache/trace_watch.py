"""What npu_graph.cache.traces watches of Dynamo while it traces: when its compiles start and end (torch's compile
callbacks), and whether a trace met anything of torch.distributed.

Dynamo folds a rank's own values into a trace without a guard: `dist.get_rank()`, `get_process_group_ranks`, a
process group's `rank()`, a device mesh's coordinates. Every value a trace reads reaches Dynamo through its
variable builders (VariableBuilder for a value with a source, SourcelessBuilder for one without); wrapped here, they
note any function, class or object of torch.distributed (its module, or its type's, is torch.distributed.* or
torch._C._distributed*) on a per-thread flag, which traces reads when Dynamo records the frame, and call
`on_distributed` the first time in a frame, so that a trace which depends on the rank is never shared between ranks.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch._dynamo.callback import callback_handler
from torch._dynamo.variables import builder

from npu_graph.cache.key import cache_key

_DISTRIBUTED = ("torch.distributed", "torch._C._distributed")
_seen = threading.local()
_hooks: dict[str, Callable[..., Any]] = {}


def _module_of(value: Any) -> str:
    for owner in (value, type(value)):
        try:
            module = getattr(owner, "__module__", None)
        except Exception:       # an object whose attribute lookup runs code of its own
            module = None
        if isinstance(module, str):
            return module
    return ""


def note(value: Any) -> None:
    """Raise this thread's flag when `value` belongs to torch.distributed."""
    if getattr(_seen, "flag", False) or not _module_of(value).startswith(_DISTRIBUTED):
        return
    _seen.flag = True
    with contextlib.suppress(Exception):        # never fail a trace for this
        _hooks["distributed"]()


def take_flag() -> bool:
    """Whether this thread's trace met torch.distributed since the flag was last taken; lowers it."""
    flag = getattr(_seen, "flag", False)
    _seen.flag = False
    return flag


def install(on_distributed: Callable[[], None]) -> None:
    """Wrap Dynamo's variable builders (module docstring); once."""
    if "distributed" in _hooks:
        return
    _hooks["distributed"] = on_distributed
    call, create = builder.VariableBuilder.__call__, builder.SourcelessBuilder.create

    def noted_call(self: Any, value: Any) -> Any:
        note(value)
        return call(self, value)

    def noted_create(tx: Any, value: Any) -> Any:
        note(value)
        return create(tx, value)

    builder.VariableBuilder.__call__ = noted_call
    builder.SourcelessBuilder.create = staticmethod(noted_create)


def watch_compiles(started: Callable[[], None], ended: Callable[[], None]) -> None:
    """Call `started` / `ended` around each of Dynamo's compiles (again after torch._dynamo.reset() cleared
    them); a compile starts with the flag down."""
    if _hooks.get("started") in callback_handler.start_callbacks:
        return

    def on_start(args: Any) -> None:
        _seen.flag = False
        started()

    def on_end(args: Any) -> None:
        ended()

    _hooks["started"], _hooks["ended"] = on_start, on_end
    callback_handler.register_start_callback(on_start)
    callback_handler.register_end_callback(on_end)


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world's size (torch.distributed's, else torchrun's environment)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def rank_key(key: str) -> str:
    """The key of this rank's own trace of `key`."""
    rank, world = rank_and_world()
    return cache_key({"trace": key, "rank": rank, "world": world})

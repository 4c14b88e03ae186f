"""Per-signature call plans: what a fused op's call of one signature runs, decided once.

A fused op's CPU path makes decisions at every call that depend only on the call's signature (shapes, strides,
dtypes, options) and the native settings: which path applies, which implementation kernels/native/dispatch.py measured
faster for the shape class, and the sizes, strides and output shapes the native entry takes. A decode step
repeats a few signatures dozens of times, and at decode sizes those decisions cost more than the math (the
tiny DeepSeek-V3.2's rms_norm: ~15 Python and torch calls of set-up around a 64-value kernel).

An op keeps a `Plans`: the first call of a signature takes the full path and then stores the plan, a callable
with those decisions made and the native entry's arguments precomputed; every later call of the signature is
one dictionary lookup and the plan. A signature must hold everything the decisions read (the plan is right for
every call that has it). Plans are keyed by the native settings too (`settings()`: ASCEND_DSA_NATIVE, the
level, the extra compiler flags, a dispatch measurement's torch path on this thread, and torch's thread count,
which dispatch measures each choice at), so changing them takes effect at the next call as before. A plan is
stored only once dispatch has a choice for its class (`dispatch.known`); a provisional choice's plans serve until
the choice expires (`clear_all_at`), then every plan is made again, from the class measured once more. While a
profiler records, no plan is used: the full path records its events.
Argument checks are not cached here (inside a compiled graph the static ones are skipped already); checks on
data stay in the plans.
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor
from torch.autograd import profiler as autograd_profiler

from npu_graph.kernels.native import env_settings
from npu_graph.kernels.native import loader as native

MAX_PLANS = 1024        # per op; a full table starts over (a growing cache length makes a signature per step)
_ALL: list[Plans] = []
_CLEAR_AT: list[float] = []     # a heap of the times at which every plan is forgotten (clear_all_at)


def settings() -> tuple[Any, ...]:
    """What every plan depends on besides its signature (module docstring)."""
    return env_settings.token(), native.is_disabled(), torch.get_num_threads()


class Plans:
    """The plans of one op, by signature (module docstring)."""

    def __init__(self, op: str):
        self.op = op
        self._plans: dict[tuple[Any, ...], Callable[..., Any]] = {}
        _ALL.append(self)

    def get(self, signature: Hashable) -> Callable[..., Any] | None:
        """The plan stored for `signature` under the current settings, or None (then take the full path)."""
        if autograd_profiler._is_profiler_enabled:
            return None
        if _CLEAR_AT and _CLEAR_AT[0] <= time.monotonic():
            _clear_due()
        return self._plans.get((settings(), signature))

    def put(self, signature: Hashable, plan: Callable[..., Any]) -> None:
        """Store `plan` for `signature` under the current settings."""
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        self._plans[(settings(), signature)] = plan

    def __len__(self) -> int:
        return len(self._plans)


def tensor_key(t: Tensor | None) -> tuple | None:
    """What a plan may depend on of one operand: shape, strides, dtype and whether it is on the CPU (None stays
    None; is_cpu costs a fifth of device.type, and a decode step builds ~100 of these keys)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.is_cpu)


def growing_key(t: Tensor | None) -> tuple | None:
    """tensor_key of a BSND cache [B, S, ...] that grows by a row per decode step, without its length S and batch
    stride: a plan that reads those at each call serves every length."""
    return None if t is None else (t.shape[0], t.shape[2:], t.stride()[1:], t.dtype, t.is_cpu)


def without_native(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A plan that runs fn with the native kernels off on this thread: an op's torch path (dispatch.torch_path)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        with native.disabled():
            return fn(*args, **kwargs)
    return call


def clear_all() -> None:
    """Forget every op's plans: the next call of each signature takes the full path again."""
    for plans in _ALL:
        plans._plans.clear()


def clear_all_at(deadline: float) -> None:
    """Forget every op's plans at `deadline` (time.monotonic()): when a provisional dispatch choice, which plans
    made until then may hold, expires."""
    heapq.heappush(_CLEAR_AT, deadline)


def _clear_due() -> None:
    now = time.monotonic()
    while _CLEAR_AT and _CLEAR_AT[0] <= now:
        heapq.heappop(_CLEAR_AT)
    clear_all()


def int_dtype(x: Tensor | None) -> torch.dtype | None:
    """The dtype a native entry reads an integer operand in (indices, lengths, a block table, key starts): its own
    when int32 or int64, else int64 (None stays None). A plan fixes it from the signature's operand."""
    return None if x is None else (x.dtype if x.dtype in (torch.int32, torch.int64) else torch.int64)


def as_table32(table: Tensor | None) -> Tensor | None:
    """A block table as a kernel that reads int32 entries takes it, contiguous: an entry outside int32's range
    becomes -1, which the kernel's check refuses, instead of wrapping onto a valid block (2**32 + 1 is not
    block 1)."""
    if table is None or (table.dtype is torch.int32 and table.is_contiguous()):
        return table
    if table.dtype is torch.int64:
        table = table.clamp(-1, 2 ** 31 - 1)
    return table.to(torch.int32).contiguous()


def as_int(x: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    """x in `dtype` (int_dtype of the plan's operand) and contiguous, copied only when it is not already."""
    if x is None or (x.dtype is dtype and x.is_contiguous()):
        return x
    return x.to(dtype).contiguous()

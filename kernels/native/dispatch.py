"""Measured dispatch: whether a fused op (or an ATen call the runtime binds) runs its native kernel or its torch
path, decided from measurements on this CPU, per instruction-set level, thread count and shape class.

A native kernel is taken only where it is faster than the path it replaces. The first call of an op in a shape
class (`shape_class`: dtypes, layout and sizes rounded up to powers of two) times both paths on the call's own
inputs, alternately (one warm-up round, then MIN_ROUNDS to ROUNDS rounds within a time budget: a call of a few
microseconds gets ~100 rounds in ENOUGH_S, so its minimum survives bursts of other work; paths that take over
LONG_S together, a prefill-sized call, are timed by the warm-up round alone, so a first call costs one call of
each path, not eight; an op may instead hand `run` a probe, the same work on a bounded part of the call), keeps
the faster
one's result and records the choice with both minima: in memory, and in `dispatch-<cpu>.json` in the native build
folder (kernels/native/trust.py's private folder), keyed by op, level, the kernel library's build, a digest of
the kernels' Python sources and the class, so a later process on this CPU starts from it (as Inductor's autotuning
caches its choices). Every later call of the class is a dictionary lookup. A first measurement whose two
paths lie within CLOSE of each other is only provisional: it serves the class for REMEASURE_S, then the class is
measured once more and that choice is kept (first use is often during a compile, whose worker processes share
the cores). Both paths must be free of side effects other than their results. A measurement runs outside any
Python dispatch or function mode (`_outside_modes`): AOT autograd runs a graph's first call under a mode that
sends every ATen call through Python (checking custom ops' aliasing), and timed there a decode-sized product's
paths both read 35-100 us instead of 2-5, with the torch path (more ATen calls) slowed most — the choice timed
the mode, and was kept. A user's mode (a flop counter) does not count the measurement's rounds either.

ASCEND_DSA_NATIVE selects the mode, read at every call: `auto` (the default) measures; `1` takes the native
kernel wherever it applies (tests and the kernel benchmarks use it to exercise the native code); `0` never
loads a native kernel (kernels/native/loader.py).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.autograd import profiler as autograd_profiler
from torch.utils import _python_dispatch

from npu_graph.cache import trust
from npu_graph.kernels.native import call_plans, cpu_isa, env_settings
from npu_graph.kernels.native import loader as native

T = TypeVar("T")
ROUNDS = 100        # at most this many timed rounds of each path (after one warm-up round) ...
MIN_ROUNDS = 3      # ... and at least this many, unless one round takes more than BUDGET_S
ENOUGH_S = 0.02     # no further rounds past MIN_ROUNDS once a measurement has taken this long (cheap ops get more:
                    # a decode-sized product's 10 rounds of ~5 us fell inside one burst of a compile's workers on
                    # the same cores, and both paths read 40-80 us; the slower one was kept on disk)
BUDGET_S = 0.5      # no further rounds once a measurement has taken this long
CLOSE = 1.5         # a first measurement whose paths lie within this factor is provisional ...
REMEASURE_S = 5.0   # ... for this long; the next call after it measures again (`_measured`)
LONG_S = 2.0        # paths that take longer than this together in the warm-up round are timed by it alone, and
                    # that choice is kept at once: a prefill-sized call of tens of seconds timed over the minimum
                    # rounds (and once more when close) spent ten minutes in a first call
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Choice:
    """What a shape class runs and the measurement behind it (milliseconds, minima over the rounds)."""
    impl: str               # "native" or "torch"
    native_ms: float
    torch_ms: float


def mode() -> str:
    """`auto`, `force` (ASCEND_DSA_NATIVE=1) or `off` (=0): module docstring."""
    value = env_settings.get(native.ENV_SWITCH, "auto")
    return {"0": "off", "1": "force"}.get(value, "auto")


def bucket(n: int) -> int:
    """n rounded up to a power of two (0 stays 0): sizes in one bucket share a measured choice."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def shape_class(*parts: Any) -> tuple:
    """A hashable class from dtypes, flags and sizes; ints are bucketed, everything else is kept as its str."""
    return tuple(bucket(p) if isinstance(p, int) and not isinstance(p, bool) else str(p) for p in parts)


def _cpu_identity() -> str:
    wanted = sorted({line for line in cpu_isa.cpuinfo_lines() if line.startswith(("model name", "flags", "Features"))})
    return hashlib.sha256("\n".join([os.uname().machine, *wanted]).encode()).hexdigest()[:16]


def table_path() -> Path:
    return native.cache_dir() / f"dispatch-{_cpu_identity()}.json"


_table: dict[str, dict[str, Any]] | None = None
_used: dict[str, set[str]] = {}            # op -> the implementations its calls ran (for the benchmarks)


def take_used() -> str:
    """"op: native[LEVEL], op2: torch, ..." ("+" where shape classes of one op differ; "-" for none): what the
    calls that went through `run` since the last take ran, for the benchmarks' rows."""
    taken = ", ".join(f"{op}: {'+'.join(sorted(impls))}" for op, impls in sorted(_used.items())) or "-"
    _used.clear()
    call_plans.clear_all()                  # a planned call does not note what it ran: the next one plans again
    return taken


def _loaded_table() -> dict[str, dict[str, Any]]:
    global _table
    if _table is None:
        try:
            _table = json.loads(trust.read_private_file(table_path()))
        except (OSError, ValueError):       # missing, damaged or untrusted: measure again
            _table = {}
    return _table


def _save(key: str, choice: Choice) -> None:
    with _LOCK:
        table = _loaded_table()
        table[key] = asdict(choice)
        try:
            folder = trust.ensure_private_dir(table_path().parent)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix="dispatch.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(table, f, indent=1, sort_keys=True)
            os.replace(tmp, table_path())
        except OSError:
            pass                            # a read-only or untrusted folder: the choice lives in this process


@functools.cache
def _paths_digest() -> str:
    """A digest of the kernels' Python sources: what an op's native and torch paths are is decided there too, so a
    choice measured with other Python code is measured again (the library's build name covers the C source)."""
    digest = hashlib.sha256()
    kernels = Path(__file__).parents[1]     # every family's modules, this package's included
    for path in sorted(kernels.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _key(op: str, library: str, cls: tuple) -> str:
    loaded = native.load(library)
    build = Path(loaded.reason).stem if loaded else library
    return f"{op}|{cpu_isa.active()}|{build}|{_paths_digest()}|{cls}|{torch.get_num_threads()} threads"


def _slot(op: str, level: str, cls: tuple) -> tuple:
    """The in-process key of a class: its op, level and class at this process's thread count. The thread count is
    part of every choice: a path that wins on 2 threads can lose on 16 (on a 16-core Xeon at the forced avx2 level
    the indexer's call took 1.5 ms on 16 threads in a process that had measured its class on 2, 0.78 ms in one that
    measured it on 16)."""
    return op, level, cls, torch.get_num_threads()


def lookup(op: str, library: str, cls: tuple) -> Choice | None:
    """The recorded choice for this class at the active level, or None when it has not been measured."""
    found = _loaded_table().get(_key(op, library, cls))
    return None if found is None else Choice(**found)


def _measure(native_fn: Callable[[], T], torch_fn: Callable[[], T],
             prepare: Callable[[], object] | None) -> tuple[T, Choice]:
    paths = {"native": native_fn, "torch": torch_fn}
    best = {name: float("inf") for name in paths}
    last: dict[str, T] = {}
    start = time.perf_counter()
    warm: dict[str, float] = {}
    for round_ in range(ROUNDS + 1):
        for name in (("native", "torch") if round_ % 2 else ("torch", "native")):
            if prepare is not None:
                prepare()
            t0 = time.perf_counter()
            last[name] = paths[name]()
            if round_:                      # round 0 warms both paths up
                best[name] = min(best[name], time.perf_counter() - t0)
            else:
                warm[name] = time.perf_counter() - t0
        spent = time.perf_counter() - start
        if round_ == 0 and spent > LONG_S:  # a long call: its warm-up round decides (`long_measurement`)
            best = warm
            break
        if round_ >= 1 and (spent > BUDGET_S or (round_ >= MIN_ROUNDS and spent > ENOUGH_S)):
            break
    impl = "native" if best["native"] <= best["torch"] else "torch"
    return last[impl], Choice(impl, best["native"] * 1e3, best["torch"] * 1e3)


def long_measurement(choice: Choice) -> bool:
    """Whether the choice was decided by the warm-up round alone: the two paths took more than LONG_S together."""
    return (choice.native_ms + choice.torch_ms) * 1e-3 > LONG_S


# (op, level, shape class) -> ("native" or "torch", its label for take_used), in this process
_known: dict[tuple, tuple[str, str]] = {}
# (op, level, shape class) -> (the provisional choice, when to measure again): see `_measured`
_provisional: dict[tuple, tuple[str, float]] = {}


def _labelled(impl: str, level: str) -> tuple[str, str]:
    """(impl, its label for take_used): "native[LEVEL]" or "torch"."""
    return impl, f"native[{level}]" if impl == "native" else "torch"


def _remember(op: str, level: str, cls: tuple, impl: str) -> tuple[str, str]:
    known = _known[_slot(op, level, cls)] = _labelled(impl, level)
    _used.setdefault(op, set()).add(known[1])
    return known


def run(op: str, library: str, cls: tuple, native_fn: Callable[[], T], torch_fn: Callable[[], T],
        prepare: Callable[[], object] | None = None,
        probe: tuple[Callable[[], object], Callable[[], object]] | None = None) -> T:
    """native_fn() or torch_fn(), whichever is faster for this shape class (module docstring). Call it only
    where the native kernel of kernels/native/<library>.c is loaded and applies to the inputs. `prepare`, when
    given, runs before every timed call, untimed (e.g. evicting an operand from the caches: the state the
    class's calls meet in use); the class should then say so, as the table keeps one choice per class. `probe`,
    when given, is the (native, torch) pair measured in their place: the same work on a bounded part of a large
    call (a slice of its rows), so a first call does not time full-size candidates; the chosen one of native_fn
    and torch_fn then runs once."""
    level = cpu_isa.active()
    slot = _slot(op, level, cls)
    # a decode step makes ~40 of these calls: one lookup each
    known = _labelled("native", level) if mode() == "force" else _known.get(slot)
    if known is None:
        pending = _provisional.get(slot)
        if pending is not None and time.monotonic() < pending[1]:
            known = _labelled(pending[0], level)
        else:
            found = None if pending is not None else _loaded_table().get(_key(op, library, cls))
            if found is None:
                return _measured(op, library, cls, level, native_fn, torch_fn, prepare, probe)
            known = _remember(op, level, cls, found["impl"])
    _used.setdefault(op, set()).add(known[1])
    chosen = native_fn if known[0] == "native" else torch_fn
    if autograd_profiler._is_profiler_enabled:  # an event naming the implementation (npu_graph.runtime.profiling)
        with autograd_profiler.record_function(f"ascend_dsa::{op}/{known[1]}"):
            return chosen()
    return chosen()


@contextlib.contextmanager
def _outside_modes() -> Iterator[None]:
    """Inside, no Python dispatch mode or torch function mode is active (module docstring)."""
    with _python_dispatch._disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def _measured(op: str, library: str, cls: tuple, level: str, native_fn: Callable[[], T], torch_fn: Callable[[], T],
              prepare: Callable[[], object] | None,
              probe: tuple[Callable[[], object], Callable[[], object]] | None = None) -> T:
    """The result of measuring both paths for the class. A first measurement whose paths lie within CLOSE of each
    other is provisional: its choice serves the class for REMEASURE_S without being kept, then the class is
    measured once more and that choice is kept (a compile's worker processes starting up on the same cores have
    slowed both paths ~10x at first use, and a choice kept on disk outlives the process)."""
    with _outside_modes():
        result, choice = _measure(native_fn, torch_fn, prepare) if probe is None else _measure(*probe, prepare)
    if probe is not None:
        result = (native_fn if choice.impl == "native" else torch_fn)()
    fast, slow = sorted((choice.native_ms, choice.torch_ms))
    slot = _slot(op, level, cls)
    if slot not in _provisional and slow < CLOSE * fast and not long_measurement(choice):
        deadline = time.monotonic() + REMEASURE_S
        _provisional[slot] = (choice.impl, deadline)
        call_plans.clear_all_at(deadline)       # the plans made from the provisional choice go with it
        _used.setdefault(op, set()).add(_labelled(choice.impl, level)[1])
        return result
    _provisional.pop(slot, None)
    _save(_key(op, library, cls), choice)
    _remember(op, level, cls, choice.impl)
    return result


def known(op: str, cls: tuple) -> str | None:
    """What `run` takes for this class now without measuring, "native" or "torch" (a provisional choice until it
    expires: kernels/native/call_plans forgets its plans then); None until it has run once for the class in this process
    (kernels/native/call_plans stores a plan only then)."""
    if mode() == "force":
        return "native"
    slot = _slot(op, cpu_isa.active(), cls)
    found = _known.get(slot)
    if found is not None:
        return found[0]
    pending = _provisional.get(slot)
    return pending[0] if pending is not None and time.monotonic() < pending[1] else None


def torch_path(fn: Callable[[], T]) -> Callable[[], T]:
    """fn run with the native kernels switched off for this thread (native.disabled): an op's torch path."""
    def without_native() -> T:
        with native.disabled():
            return fn()
    return without_native


def describe(op: str, library: str, cls: tuple) -> dict[str, Any]:
    """For summary.json and the benchmarks: what this class runs at the active level, and why."""
    level = cpu_isa.active()
    if mode() != "auto":
        return {"level": level, "impl": "native" if mode() == "force" else "torch",
                "why": f"{native.ENV_SWITCH}={os.environ.get(native.ENV_SWITCH)}"}
    if not native.load(library):
        return {"level": level, "impl": "torch", "why": native.load(library).reason}
    choice = lookup(op, library, cls)
    pending = _provisional.get(_slot(op, level, cls))
    if choice is None and pending is not None:
        return {"level": level, "impl": pending[0], "why": f"provisional: both paths within {CLOSE}x at first "
                                                            "use, measured again at a later call"}
    if choice is None:
        return {"level": level, "impl": "measured at first call", "why": "not yet measured on this CPU"}
    return {"level": level, "impl": choice.impl, "native_ms": round(choice.native_ms, 4),
            "torch_ms": round(choice.torch_ms, 4),
            "why": f"measured: native {choice.native_ms:.3g} ms vs torch {choice.torch_ms:.3g} ms"}

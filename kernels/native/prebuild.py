"""Native libraries built ahead, on a thread, while the first graph is traced and its passes run.

A first compile on a machine without built libraries used to build each one where the CPU lowering first needed
it (implementations, dispatch measurements), on the compiling thread: ~5 s for the 8 libraries of a tiny
DeepSeek-V3.2 on a 2-core Zen 4, one after the other, while the other core idled. The first time in a process
that torch resolves the backend's name (`start_ahead`, from npu_graph.backend_entry: `torch.compile(...,
backend="ascend_dsa")`), or else at the first compile the compile cache missed (`building_ahead()`), one thread
starts building the libraries not yet in the cache folder, in ORDER (those most model families use first), while
Dynamo traces the first graph and the graph is captured and its passes run. It stops once the compile knows
which libraries its fused ops need (`build_now`, from observe.implementations: those are built two at a time, by
the compiling thread and a helper, with no guess beside them on a 2-core machine) or once that compile is over,
whichever comes first, so later work (Inductor's compiles of other graphs) has the cores to itself.
kernels/native/loader.build_once keeps two threads from building one library twice.

The thread only builds: loading, the checks of a library's build record and every warning stay with
kernels/native/loader.load. A failed build here is quiet, and so is a folder or level it cannot use; load builds the
library again and reports it. At exit the build under way completes (no half-written file is left). Nothing
starts when ASCEND_DSA_NATIVE=0 is set or there is no C compiler.
"""
from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from npu_graph.cache import trust
from npu_graph.kernels.native import cpu_isa, env_settings
from npu_graph.kernels.native import loader as native
from npu_graph.observe import progress

# Most families' libraries first (the norms, projections and MoE of every decoder), then the attention kinds.
ORDER = ("skinny_mm", "rms_norm", "moe_gating", "fused_moe", "causal_lengths", "rotary_mul", "lightning_indexer",
         "sparse_attention", "dense_attention", "depthwise_conv1d", "kda", "attn_res")

_STARTED = threading.Event()
_AHEAD_STOP = threading.Event()    # set when the compile ends, or when it knows which libraries it needs


def _missing(names: Sequence[str]) -> tuple[str | None, str, list[tuple[str, Path]]]:
    """(the compiler, the active level, (name, library path) of each of `names` not in the cache folder)."""
    cc, level = native.compiler(), cpu_isa.active()
    if cc is None:
        return None, level, []
    paths = [(name, native.library_path(name, cc, level)) for name in dict.fromkeys(names)]
    if paths:
        trust.ensure_private_dir(paths[0][1].parent)
    return cc, level, [(name, path) for name, path in paths if not path.exists()]


def _build_each(cc: str, level: str, todo: list[tuple[str, Path]], stop: threading.Event | None = None) -> None:
    """Builds each library of `todo` that no other thread is building and is still missing, until `stop` is set;
    quiet by design: load() builds a failed one again and reports what failed."""
    try:
        for name, path in todo:
            if stop is not None and stop.is_set():
                return
            if not path.exists():
                native.build_unless_busy(name, path, cc, level)
    except Exception:
        return


def _finish(thread: threading.Thread) -> None:
    """At exit: no new build, and the one under way completes (its library lands, its temporary file goes)."""
    _AHEAD_STOP.set()
    thread.join(native.BUILD_TIMEOUT_S)


def _switched_off() -> bool:
    return env_settings.get(native.ENV_SWITCH) == "0"


def start_ahead() -> None:
    """The thread of the module docstring, the first time in this process (nothing when switched off or when
    every library is in the cache folder). Started when torch first resolves the backend by name
    (npu_graph.backend_entry), so that the builds overlap Dynamo's tracing of the first graph, or else by the first
    compile that misses the cache (`building_ahead`)."""
    if _STARTED.is_set() or _switched_off():
        return
    _STARTED.set()
    try:
        cc, level, todo = _missing(ORDER)
    except Exception:   # a forced level this CPU lacks, an untrusted folder: load() reports them
        return
    if todo:
        thread = threading.Thread(target=_build_each, args=(cc, level, todo, _AHEAD_STOP),
                                  name="ascend-dsa-native-prebuild", daemon=True)
        thread.start()
        atexit.register(_finish, thread)


@contextlib.contextmanager
def building_ahead() -> Iterator[None]:
    """Around the compile of a graph the compile cache missed: `start_ahead`, and the guesses stop when the compile
    ends (the first one's end stops them, whoever started them)."""
    start_ahead()
    try:
        yield
    finally:
        _AHEAD_STOP.set()


def build_now(names: Sequence[str]) -> None:
    """The missing libraries of `names` (a graph about to load them), two builds at a time: this thread and a
    helper each take the next one no thread is building; returns when none of them is being built."""
    if _switched_off():
        return
    _AHEAD_STOP.set()          # a guess no longer: these are the ones needed, and the cores are theirs
    try:
        cc, level, todo = _missing(names)
    except Exception:   # a forced level this CPU lacks, an untrusted folder: load() reports them
        return
    if not todo:
        return
    with progress.step(f"building native kernels {', '.join(name for name, _ in todo)} ({level})"):
        helper = threading.Thread(target=_build_each, args=(cc, level, todo[::-1]), daemon=True)
        helper.start()
        _build_each(cc, level, todo)
        helper.join()
        for _, path in todo:
            native.wait_for_build(path)

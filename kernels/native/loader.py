"""Native CPU kernels: the plain C sources in kernels/native/ (no torch headers), compiled at first use with the
system C compiler and loaded with ctypes; callers pass tensor.data_ptr() pointers to the functions
kernels/native/prototypes.py types from their C declarations (no hand-written argtypes).

`load(name)` builds kernels/native/<name>.c for the active instruction-set level (kernels/native/cpu_isa.py: detected,
or forced lower with ASCEND_DSA_CPU_ISA) once per machine and process; `native_entry` binds a compiled graph's
ATen calls to a kernel module's native-or-ATen function. Every level has its own flags (LEVEL_FLAGS) and so its
own library: the sources size their vectors and register tiles from the level (kernels/native/simd.h), as
oneDNN selects per-ISA code at run time. Why plain C per level rather than a C++ extension on torch's
`at::vec::Vectorized`: no torch headers to compile (a kernel builds in about a second, not minutes), no tie to
torch's C++ ABI, and the level of every path can be forced and tested on one machine.

The shared library goes into a cache folder (ASCEND_DSA_NATIVE_DIR, else $XDG_CACHE_HOME/ascend_dsa/native, else
~/.cache/ascend_dsa/native) under a file name keyed by a hash of the source (with the folder's headers), the
compiler and the flags; it is written to a temporary file and renamed into place, and built by one process at a
time: a process that finds another one building it (its lease in the folder, npu_graph.cache.locks: a fleet's
ranks starting on a fresh machine) waits for that build, and later processes load it without compiling. The
compiler is ASCEND_DSA_CC or CC, else `cc` or `gcc` on PATH. torch is imported first, so the library's OpenMP
(libgomp.so.1) resolves to the runtime torch already loaded: no second thread pool.

There is one fallback: when no compiler is found, the build fails or the library cannot be loaded, or
ASCEND_DSA_NATIVE=0 is set, `load` returns a Native without a library whose `reason` says why, and the ops
keep their torch path; a failed build (with the compiler's error) and a missing compiler are each reported by
one NativeLibraryWarning. A build shows progress on stderr (npu_graph.observe.progress).
Where both exist, kernels/native/dispatch.py decides per shape class which one runs.
"""
import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch  # loaded before any native library: its libgomp is the one the libraries use

from npu_graph.cache import locks, trust
from npu_graph.kernels.native import cpu_isa, env_settings
from npu_graph.kernels.native import trust as native_trust
from npu_graph.observe import progress

SOURCE_DIR = Path(__file__).parent     # the C sources sit beside this package's modules
# The dtype codes every kernel's `dtype` argument takes (the C sources' enum F32, BF16, F16).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# Flags per instruction-set level (kernels/native/cpu_isa.py). x86-64-v3 is AVX2 + FMA + F16C + BMI; x86-64-v4 adds
# AVX-512 F/BW/CD/DQ/VL, whose 512-bit vectors the compiler then also uses for the loops it vectorises itself.
_X86_LEVEL_FLAGS = {
    "generic": ("-march=x86-64", "-mtune=generic"),
    "avx2": ("-march=x86-64-v3", "-mtune=generic"),
    "avx512": ("-march=x86-64-v4", "-mtune=generic", "-mprefer-vector-width=512"),
    "avx512_bf16": ("-march=x86-64-v4", "-mavx512bf16", "-mtune=generic", "-mprefer-vector-width=512"),
    "amx_bf16": ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mtune=generic",
                 "-mprefer-vector-width=512"),
}
# The amx_bf16 level with its tile instructions emulated in C (kernels/native/cpu_isa.amx_emulated, for tests).
_AMX_EMULATED_FLAGS = (*(flag for flag in _X86_LEVEL_FLAGS["amx_bf16"] if not flag.startswith("-mamx")),
                       "-DASCEND_DSA_AMX_EMULATED")
BUILD_TIMEOUT_S = 120
ENV_SWITCH = env_settings.SWITCH
ENV_DIR = "ASCEND_DSA_NATIVE_DIR"
ENV_CC = "ASCEND_DSA_CC"
ENV_CFLAGS = env_settings.CFLAGS


@dataclass(frozen=True)
class Native:
    """A loaded native library, or None and the reason the torch path is used instead."""
    lib: ctypes.CDLL | None
    reason: str     # the library's path when loaded

    def __bool__(self) -> bool:
        return self.lib is not None


def cache_dir() -> Path:
    """Where built libraries are kept (module docstring)."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ascend_dsa" / "native"


def compiler() -> str | None:
    """The C compiler command (module docstring), or None when there is none."""
    chosen = os.environ.get(ENV_CC) or os.environ.get("CC")
    if chosen:
        return chosen
    return shutil.which("cc") or shutil.which("gcc")


def level_flags(level: str) -> tuple[str, ...]:
    """The compiler flags of one level: FLAGS, plus the level's target flags on x86 (elsewhere only the
    generic level exists, built for the architecture's baseline; amx_bf16 emulated: its flags without AMX's), plus
    ASCEND_DSA_NATIVE_CFLAGS."""
    extra = tuple(env_settings.get(ENV_CFLAGS, "").split())
    if not cpu_isa.is_x86():
        return FLAGS + extra
    if level == "amx_bf16" and cpu_isa.amx_emulated():
        return FLAGS + _AMX_EMULATED_FLAGS + extra
    return FLAGS + _X86_LEVEL_FLAGS[level] + extra


def library_path(name: str, cc: str, level: str) -> Path:
    """The cache file for source `name` built by `cc` for `level`."""
    digest = hashlib.sha256()
    headers = [path.read_bytes() for path in sorted(SOURCE_DIR.glob("*.h"))]   # sources may include them
    for part in ((SOURCE_DIR / f"{name}.c").read_bytes(), *headers, cc.encode(), " ".join(level_flags(level)).encode(),
                 platform.machine().encode()):
        digest.update(part)
        digest.update(b"\0")
    return cache_dir() / f"{name}-{level}-{digest.hexdigest()[:20]}.so"


def _build(source: Path, target: Path, cc: str, level: str) -> str | None:
    """Compiles source into target for `level` (atomically, with its build record); None, or why it failed."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        done = subprocess.run([cc, *level_flags(level), "-o", tmp, str(source)], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            return f"`{cc}` failed to build {source.name} for {level}: {done.stderr.strip()[-800:]}"
        os.chmod(tmp, 0o700)
        native_trust.write_record(target, Path(tmp).read_bytes())
        os.replace(tmp, target)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not run the C compiler `{cc}` on {source.name}: {e}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# Libraries being built right now in this process (a graph's compile and prebuild.py's thread), each with the
# event its builder sets when done: a second thread needing one waits for that build instead of running another.
_BUILDING: dict[Path, threading.Event] = {}
_BUILDING_LOCK = threading.Lock()


def _claim(path: Path) -> bool:
    """Marks `path` as being built by this thread; False when another thread is building it."""
    with _BUILDING_LOCK:
        if path in _BUILDING:
            return False
        _BUILDING[path] = threading.Event()
        return True


def _release(path: Path) -> None:
    with _BUILDING_LOCK:
        _BUILDING.pop(path).set()


def wait_for_build(path: Path) -> None:
    """Returns once no thread of this process is building `path`."""
    with _BUILDING_LOCK:
        event = _BUILDING.get(path)
    if event is not None:
        event.wait()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


@contextlib.contextmanager
def _one_builder(name: str, path: Path, level: str) -> Iterator[Callable[[], bool]]:
    """Hold the library's lease while building it, once no other process is (the folder's lease); yields whether
    another process has built it since (a new file at `path`: one that was there before may have been refused)."""
    before = _identity(path)

    def built_meanwhile() -> bool:
        return _identity(path) not in (None, before)

    work = locks.Work(f"building native kernel {name} ({level})", f"the build of native kernel {name} ({level})",
                      "building it here as well")
    try:
        lease = locks.take_lease(f"{path}.lease", work, 2 * BUILD_TIMEOUT_S, built_meanwhile)
    except OSError:     # a folder this process cannot write: _build reports it
        lease = None
    try:
        yield built_meanwhile
    finally:
        if lease is not None:
            lease.release()


def _build_claimed(name: str, path: Path, cc: str, level: str) -> str | None:
    try:
        with _one_builder(name, path, level) as built_meanwhile:
            return None if built_meanwhile() else _build(SOURCE_DIR / f"{name}.c", path, cc, level)
    finally:
        _release(path)


def build_unless_busy(name: str, path: Path, cc: str, level: str) -> str | None:
    """Builds kernels/native/<name>.c into `path` (_build) unless another thread of this process is building it
    (then returns at once). None, or why the build failed."""
    return _build_claimed(name, path, cc, level) if _claim(path) else None


def build_once(name: str, path: Path, cc: str, level: str) -> str | None:
    """Builds kernels/native/<name>.c into `path`; where another thread of this process is building it, waits for
    that build and builds here only if it left no library. None, or why the build failed."""
    while not _claim(path):
        wait_for_build(path)
        if path.exists():
            return None
    return _build_claimed(name, path, cc, level)


def load(name: str) -> Native:
    """The library built from kernels/native/<name>.c for the active level, building it on first use (module
    docstring). ASCEND_DSA_NATIVE=0 and ASCEND_DSA_CPU_ISA are read at every call, so they may be set at any
    time; a forced level this CPU lacks raises cpu_isa.IsaError."""
    if env_settings.get(ENV_SWITCH) == "0":
        return Native(None, f"{ENV_SWITCH}=0 is set")
    if _THREAD.disabled:
        return Native(None, "the torch path was chosen for this call (kernels/native/dispatch.py)")
    return _load(name, cpu_isa.active(), env_settings.get(ENV_CFLAGS, ""))


class _ThreadState(threading.local):
    disabled = False        # a class default: reading a missing thread-local attribute raises inside, ~1.5 us


_THREAD = _ThreadState()


def is_disabled() -> bool:
    """Whether `load` returns no library on this thread (inside `disabled`)."""
    return _THREAD.disabled


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Inside, `load` returns no library on this thread: the ops take their torch paths (kernels/native/dispatch.py
    times them against the native ones this way)."""
    before = _THREAD.disabled
    _THREAD.disabled = True
    try:
        yield
    finally:
        _THREAD.disabled = before


class NativeLibraryWarning(UserWarning):
    """A native library or its build folder was refused (native_trust): rebuilt, or the torch path is used."""


NO_COMPILER = f"no C compiler found (set {ENV_CC} or CC, or install cc/gcc)"


@functools.cache
def _warn_no_compiler() -> None:
    """Once per process: without a compiler every fused op runs its torch path."""
    warnings.warn(f"ascend_dsa: {NO_COMPILER}; the fused ops use their torch paths (correct, slower on small "
                  f"shapes). summary.json's `implementations` lists what each op runs.", NativeLibraryWarning,
                  stacklevel=4)


@functools.cache
def _load(name: str, level: str, extra_flags: str) -> Native:
    """One library per name, level and extra flags (the last two only key the cache: level_flags reads them)."""
    cc = compiler()
    if cc is None:
        _warn_no_compiler()
        return Native(None, NO_COMPILER)
    try:
        path = library_path(name, cc, level)
        trust.ensure_private_dir(path.parent)
        wait_for_build(path)
        fd, why = native_trust.open_verified(path) if path.exists() else (None, "")
        if fd is None:
            if why:
                warnings.warn(f"ascend_dsa refused the native library {path}: {why}; rebuilding it",
                              NativeLibraryWarning, stacklevel=3)
            with progress.step(f"building native kernel {name} ({level})"):
                failure = build_once(name, path, cc, level)
            if failure:
                warnings.warn(f"ascend_dsa could not build its native kernel {name}; its op uses the torch path. "
                              f"{failure}", NativeLibraryWarning, stacklevel=3)
                return Native(None, failure)
            fd, why = native_trust.open_verified(path)
            if fd is None:
                return Native(None, f"the native library {path} just built was refused: {why}")
        # The descriptor stays open for the life of the process: the loader knows a library by its name, and a
        # closed descriptor's number (so its /proc/self/fd name) would be reused for the next library.
        return Native(ctypes.CDLL(native_trust.loadable_path(path, fd)), str(path))
    except trust.UntrustedPath as e:
        warnings.warn(f"ascend_dsa does not load native kernels from an untrusted folder ({e}); the ops use their "
                      f"torch paths", NativeLibraryWarning, stacklevel=3)
        return Native(None, f"untrusted native build folder: {e}")
    except OSError as e:
        return Native(None, f"could not build or load the native library {name}: {e}")


def available(name: str) -> tuple[bool, str]:
    """(whether kernels/native/<name>.c is loaded, its path or why the torch path is used)."""
    native = load(name)
    return bool(native), native.reason


def native_entry(library: str, make: Callable[[ctypes.CDLL], Callable[..., Any]]) -> Callable[..., Any] | None:
    """For the CPU runtime's binder (npu_graph.runtime.direct_calls): make(lib), lib being kernels/native/<library>.c
    loaded, or None when it is not (ASCEND_DSA_NATIVE=0 is read here, when a graph is loaded)."""
    loaded = load(library)
    return make(loaded.lib) if loaded else None

"""Native CPU kernels: the plain C sources in kernels/native/ (no torch headers), compiled at first use with the
system C compiler and loaded with ctypes; callers pass tensor.data_ptr() pointers.

`load(name)` builds kernels/native/<name>.c once per machine and process; `bind_calls` binds a compiled graph's
ATen calls to a kernel module's native-or-ATen function. The shared library goes into a cache
folder (ASCEND_DSA_NATIVE_DIR, else $XDG_CACHE_HOME/ascend_dsa/native, else ~/.cache/ascend_dsa/native) under a
file name keyed by a hash of the source (with the folder's headers), the compiler, the flags and the CPU
(`-march=native` code only runs on the CPU it was built for); it is written to a temporary file and renamed into
place, so processes building at the same time are safe, and later processes load it without compiling. The
compiler is ASCEND_DSA_CC or CC, else `cc` or `gcc` on PATH. torch is imported first, so the library's OpenMP
(libgomp.so.1) resolves to the runtime torch already loaded: no second thread pool.

There is one fallback: when no compiler is found, the build fails or the library cannot be loaded, or
ASCEND_DSA_NATIVE=0 is set, `load` returns a Native without a library whose `reason` says why, and the ops
keep their torch path.
"""
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch  # loaded before any native library: its libgomp is the one the libraries use

SOURCE_DIR = Path(__file__).parent / "native"
# The dtype codes every kernel's `dtype` argument takes (the C sources' enum F32, BF16, F16).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
BUILD_TIMEOUT_S = 120
ENV_SWITCH = "ASCEND_DSA_NATIVE"
ENV_DIR = "ASCEND_DSA_NATIVE_DIR"
ENV_CC = "ASCEND_DSA_CC"


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


def _cpu_identity() -> str:
    """Machine and CPU flags: a library built with -march=native is tied to them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.startswith(("flags", "model name", "Features"))]
    return "\n".join([platform.machine(), platform.processor(), *sorted(set(wanted))])


def library_path(name: str, cc: str) -> Path:
    """The cache file for source `name` built by `cc` on this CPU."""
    digest = hashlib.sha256()
    headers = [path.read_bytes() for path in sorted(SOURCE_DIR.glob("*.h"))]   # sources may include them
    for part in ((SOURCE_DIR / f"{name}.c").read_bytes(), *headers, cc.encode(), " ".join(FLAGS).encode(),
                 _cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    return cache_dir() / f"{name}-{digest.hexdigest()[:20]}.so"


def _build(source: Path, target: Path, cc: str) -> str | None:
    """Compiles source into target (atomically); None, or why it failed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(source)], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            return f"`{cc}` failed to build {source.name}: {done.stderr.strip()[-800:]}"
        os.replace(tmp, target)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not run the C compiler `{cc}` on {source.name}: {e}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(name: str) -> Native:
    """The library built from kernels/native/<name>.c, building it on first use (module docstring).
    ASCEND_DSA_NATIVE=0 is read at every call, so it may be set at any time."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return Native(None, f"{ENV_SWITCH}=0 is set")
    return _load(name)


@functools.cache
def _load(name: str) -> Native:
    cc = compiler()
    if cc is None:
        return Native(None, f"no C compiler found (set {ENV_CC} or CC, or install cc/gcc)")
    try:
        path = library_path(name, cc)
        if not path.exists():
            failure = _build(SOURCE_DIR / f"{name}.c", path, cc)
            if failure:
                return Native(None, failure)
        return Native(ctypes.CDLL(str(path)), str(path))
    except OSError as e:
        return Native(None, f"could not build or load the native library {name}: {e}")


def available(name: str) -> tuple[bool, str]:
    """(whether kernels/native/<name>.c is loaded, its path or why the torch path is used)."""
    native = load(name)
    return bool(native), native.reason


def bind_calls(source: str, call: str, name: str, library: str,
               make: Callable[[ctypes.CDLL], Callable[..., Any]]) -> tuple[str, dict[str, Any]]:
    """For the CPU runtime: `source` with every `call` (the text "torch.ops.aten.<op>.<overload>(") calling
    `name` instead, and {name: make(lib)} for the namespace it runs in, lib being kernels/native/<library>.c
    loaded; the source unchanged and no entry when it has no such call or the library is not loaded
    (ASCEND_DSA_NATIVE=0 is read here, when the graph is built)."""
    if call not in source:
        return source, {}
    loaded = load(library)
    if not loaded:
        return source, {}
    return source.replace(call, f"{name}("), {name: make(loaded.lib)}

"""Which x86 instruction-set level the native kernels run at: detection, and forcing a lower level.

The native kernels (kernels/native/*.c) are built once per level, each with its own compiler flags, and the
library of the active level is loaded (kernels/native/loader.py). Like oneDNN (`ONEDNN_MAX_CPU_ISA`) and PyTorch
(`ATEN_CPU_CAPABILITY`), the level is detected at run time and can be forced lower with
ASCEND_DSA_CPU_ISA=generic|avx2|avx512|avx512_bf16|amx_bf16, so that every level's code is built, tested and
benchmarked on any machine that can execute it. A level the CPU lacks, or a name that is not a level, is a
clear error (IsaError) at the first native call.

Levels, lowest first (each includes the ones before it):
- generic: portable C, vectorised by the compiler for the architecture's baseline (SSE2 on x86-64, NEON on
  aarch64). The only level on other architectures.
- avx2: x86-64-v3 (AVX2, FMA, F16C, BMI1/2): 8 fp32 lanes, 16 vector registers.
- avx512: x86-64-v4 (AVX-512 F, BW, CD, DQ, VL): 16 fp32 lanes, 32 vector registers.
- avx512_bf16: avx512 plus AVX512-BF16 (bf16 dot products).
- amx_bf16: avx512_bf16 plus AMX tiles with bf16 dot products (Sapphire Rapids and later Xeons): the bf16
  indexer and sparse attention multiply 16 x 32 by 32 x 16 tiles. Linux hands a process the tile state only when
  asked (arch_prctl ARCH_REQ_XCOMP_PERM); the level counts as supported once that request succeeds.

ASCEND_DSA_AMX_EMULATED=1 (read once per process; for tests) builds the amx_bf16 level with its tile instructions
emulated in C (kernels/native/amx_emulated.h) and counts it as supported wherever avx512_bf16 is: the level's
code is then tested, under the sanitizers too, on CPUs without AMX. It is slow; the benchmarks refuse it.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path

from npu_graph.kernels.native import env_settings

LEVELS = ("generic", "avx2", "avx512", "avx512_bf16", "amx_bf16")
ENV_ISA = env_settings.ISA
ENV_AMX_EMULATED = "ASCEND_DSA_AMX_EMULATED"

# /proc/cpuinfo flags each level needs (the kernel lists a flag only when the OS saves the registers too).
_REQUIRED = {
    "avx2": {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"},
    "avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "avx512_bf16": {"avx512_bf16"},
    "amx_bf16": {"amx_tile", "amx_bf16"},
}
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18   # x86-64 Linux
# torch's own detection, for x86 machines without /proc/cpuinfo (it says nothing about bf16).
_TORCH_CAPABILITY = {"AVX2": "avx2", "AVX512": "avx512"}


class IsaError(ValueError):
    """ASCEND_DSA_CPU_ISA names no level, or one this CPU cannot execute."""


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


@functools.cache
def cpuinfo_lines() -> tuple[str, ...]:
    """The lines of /proc/cpuinfo (none where it cannot be read), read once."""
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def _cpuinfo_flags() -> set[str] | None:
    for line in cpuinfo_lines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def _tile_state_granted() -> bool:
    """Asks Linux for this process's AMX tile state (once is enough for every thread); whether it was granted."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


@functools.cache
def amx_emulated() -> bool:
    """Whether ASCEND_DSA_AMX_EMULATED=1 asks for the amx_bf16 level in C emulation (module docstring)."""
    value = os.environ.get(ENV_AMX_EMULATED, "").strip()
    if value not in ("", "0", "1"):
        raise IsaError(f"{ENV_AMX_EMULATED}={value!r}: use 1 (emulate the AMX tile instructions, for tests) or 0")
    return value == "1"


def _runs(level: str, needed: set[str], flags: set[str]) -> bool:
    if level != "amx_bf16":
        return needed <= flags
    if amx_emulated():
        return needed - _REQUIRED[level] <= flags
    return needed <= flags and _tile_state_granted()


def _levels_from_flags(flags: set[str]) -> tuple[str, ...]:
    levels, needed = ["generic"], set()
    for level in LEVELS[1:]:
        needed |= _REQUIRED[level]
        if not _runs(level, needed, flags):
            break
        levels.append(level)
    return tuple(levels)


@functools.cache
def supported() -> tuple[str, ...]:
    """The levels this CPU can execute, lowest first ("generic" always)."""
    if not is_x86():
        return ("generic",)
    amx_emulated()          # a wrong value is an error on every x86 CPU, not only where it would matter
    flags = _cpuinfo_flags()
    if flags is not None:
        return _levels_from_flags(flags)
    import torch

    best = _TORCH_CAPABILITY.get(torch.backends.cpu.get_cpu_capability(), "generic")
    return LEVELS[: LEVELS.index(best) + 1]


def best() -> str:
    """The highest level this CPU can execute."""
    return supported()[-1]


def active() -> str:
    """The level the native kernels run at: ASCEND_DSA_CPU_ISA when set (checked), else `best()`. Read at every
    call, so the level can be forced at any time."""
    forced = env_settings.get(ENV_ISA)
    if not forced:
        return best()
    return check_level(forced)


def check_level(name: str) -> str:
    """`name` as a level this CPU can execute, else IsaError saying what can be used."""
    level = name.strip().lower()
    if level not in LEVELS:
        raise IsaError(f"{ENV_ISA}={name!r} is not an instruction-set level; use one of {list(LEVELS)}")
    if level not in supported():
        missing = set().union(*(_REQUIRED[lv] for lv in LEVELS[1:LEVELS.index(level) + 1]))
        have = _cpuinfo_flags() or set()
        raise IsaError(f"{ENV_ISA}={name!r}: this CPU ({platform.machine()}) cannot execute {level} code "
                       f"(missing: {', '.join(sorted(missing - have)) or 'an x86 CPU'}); the levels it can run are "
                       f"{list(supported())}")
    return level

"""This process's resident memory (Linux /proc): now, its peak (VmHWM) and a reset of that peak, so a benchmark
can report the peak of one piece of work as the high-water mark above the memory held before it."""
from __future__ import annotations

from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK = "5"       # clear_refs: set the peak resident size to the current one (Linux >= 4.0)


def _status_bytes(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line: resident memory is measured on Linux only")


def resident_bytes() -> int:
    """Resident memory of this process now (VmRSS)."""
    return _status_bytes("VmRSS")


def peak_bytes() -> int:
    """Peak resident memory of this process since it started or since `reset_peak` (VmHWM)."""
    return _status_bytes("VmHWM")


def reset_peak() -> bool:
    """Make the peak the current resident memory; False where the kernel does not allow it (the peak then
    counts from the process's start)."""
    try:
        _CLEAR_REFS.write_text(_RESET_PEAK)
    except OSError:
        return False
    return True

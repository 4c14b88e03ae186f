"""Per-rank programs for the launch tests (importable by name in spawned ranks): ranks that start a child
process, then end early, die, raise or hang while the other ranks wait for them in a barrier."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

CHILD_MARK = "ascend_dsa_launch_test_child"


def start_child(record_dir: str) -> int:
    """Start a sleeping child that inherits every descriptor of the rank (its exit sentinel and report pipe
    too); write its pid to `record_dir/child<rank>` (atomically) and return it."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", CHILD_MARK], close_fds=False)
    path = Path(record_dir) / f"child{dist.get_rank()}"
    path.with_suffix(".tmp").write_text(str(child.pid))
    path.with_suffix(".tmp").rename(path)
    return child.pid


def misbehave(culprit: int, how: str, record_dir: str) -> int:
    """Every rank starts a child; rank `culprit` then writes the time to `record_dir/ending` and ends as
    `how` says while the others wait in a barrier (with no culprit, every rank returns its child's pid)."""
    child = start_child(record_dir)
    if dist.get_rank() == culprit:
        Path(record_dir, "ending").write_text(repr(time.time()))
        if how == "os._exit(0)":
            os._exit(0)
        if how == "sys.exit(0)":
            sys.exit(0)
        if how == "os._exit(3)":
            os._exit(3)
        if how == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "segfault":
            ctypes.string_at(0)
        if how == "raise":
            raise ValueError("rank failure injected by the test")
        time.sleep(3600)
    dist.barrier()
    return child

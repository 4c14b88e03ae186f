"""Start copies of one `torchrun` command on this host (one copy per simulated node) and wait for all of them.

Used where the project runs real `torchrun` launches on one machine: the torchrun tests, the guide's commands and
`ascend-dsa bench fleet`. A rendezvous endpoint needs a free local port (`free_port`); `run_copies` starts every
copy at once with its output in a log file of its own, waits for all of them under one deadline and kills every
copy that is still running when the wait ends, however it ends, so no launch outlives its caller.
"""
from __future__ import annotations

import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a c10d rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_copies(argv: Sequence[str], logs: Sequence[Path], env: Mapping[str, str], timeout_s: float,
               cwd: Path | None = None) -> list[int]:
    """Run `argv` once per log file, all at once, each writing stdout and stderr to its log; their exit codes.
    Every copy still running after `timeout_s` seconds (or when the wait is interrupted) is killed."""
    procs = []
    try:
        for log in logs:
            with log.open("w") as out:
                procs.append(subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdout=out,
                                              stderr=subprocess.STDOUT))
        return [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()

"""Copies of one command started at once on this host: each logs to its own file, exit codes come back in order,
and a copy still running at the deadline is killed rather than left behind."""
import socket
import subprocess
import sys
import time

import pytest

from npu_graph.parallel.torchrun_copies import free_port, run_copies


def test_every_copy_runs_with_its_own_log_and_exit_code(tmp_path):
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    argv = [sys.executable, "-c", "import os, sys; print('copy', os.getpid()); sys.exit(3)"]
    assert run_copies(argv, logs, {"PATH": ""}, timeout_s=60) == [3, 3]
    pids = {log.read_text().split()[1] for log in logs}
    assert len(pids) == 2


def test_a_copy_past_the_deadline_is_killed(tmp_path):
    marker = tmp_path / "still-running"
    argv = [sys.executable, "-c", f"import time; time.sleep(30); open({str(marker)!r}, 'w')"]
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_copies(argv, [tmp_path / "node0.log"], {}, timeout_s=1)
    assert time.monotonic() - start < 20
    time.sleep(1)
    assert not marker.exists()


def test_a_free_port_can_be_bound():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))

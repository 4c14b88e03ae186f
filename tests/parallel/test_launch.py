"""npu_graph.parallel.launch (torch.distributed.elastic's launcher underneath) on real processes: every way a
rank can end early is reported within the timeout and names that rank (a crash with the stacks faulthandler
wrote), a function that cannot reach the ranks is refused before any starts, and no rank nor any process a rank
started outlives launch.

Each rank starts a sleeping child that inherits all its descriptors; the tests check that it is gone.
Starting two ranks takes ~5-10 s on two busy cores, so the rarer endings are slow-marked.
"""
import multiprocessing
import os
import signal
import sys
import threading
import time
import types
from pathlib import Path

import launch_workers
import pytest

from npu_graph.parallel import DistributedLaunchError, launch

TIMEOUT_S = 60.0
REPORTED_WITHIN_S = 3.0     # from a rank's ending to launch raising, its peers stopped and reaped


def _running(pid: int) -> bool:
    """Whether the test child `pid` is alive (not gone, not a zombie, not a reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return launch_workers.CHILD_MARK.encode() in cmdline and state != "Z"


def _children(record_dir: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(record_dir.glob("child[0-9]"))]


@pytest.fixture
def record_dir(tmp_path):
    """Where ranks write their children's pids; a child still running at teardown is killed."""
    yield tmp_path
    for pid in filter(_running, _children(tmp_path)):
        os.kill(pid, signal.SIGKILL)


def assert_nothing_left(record_dir: Path, children: int) -> None:
    """No rank is left, and the `children` children the ranks started are gone (within 1 s)."""
    assert multiprocessing.active_children() == []
    pids = _children(record_dir)
    assert len(pids) == children
    deadline = time.monotonic() + 1.0
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(map(_running, pids))


ENDINGS = [  # (how the last rank ends, world size, what the error says about it)
    pytest.param("os._exit(0)", 2, r"rank 1 died \(exit code 0\) before reporting a result", id="exit0"),
    pytest.param("SIGKILL", 1, r"rank 0 died \(killed by SIGKILL\) before reporting a result", id="sigkill"),
    pytest.param("SIGKILL", 2, r"rank 1 died \(killed by SIGKILL\) before reporting a result", id="sigkill2",
                 marks=pytest.mark.slow),
    pytest.param("sys.exit(0)", 2, r"(?s)rank 1 raised an exception.*SystemExit: 0", id="sys_exit0",
                 marks=pytest.mark.slow),
    pytest.param("os._exit(3)", 2, r"rank 1 died \(exit code 3\) before reporting a result", id="exit3",
                 marks=pytest.mark.slow),
    pytest.param("raise", 2, r"(?s)rank 1 raised an exception.*rank failure injected", id="raise",
                 marks=pytest.mark.slow),
    pytest.param("segfault", 2, r"(?s)rank 1 died \(killed by SIGSEGV\) before reporting a result\n.*Segmentation "
                 r"fault.*in misbehave", id="segfault", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("how", "world_size", "message"), ENDINGS)
def test_rank_ending_early_is_named_at_once(record_dir, how, world_size, message):
    culprit = world_size - 1
    with pytest.raises(DistributedLaunchError, match=message) as error:
        launch(launch_workers.misbehave, world_size, args=(culprit, how, str(record_dir)), timeout_s=TIMEOUT_S)
    assert "the other ranks were stopped" in str(error.value)
    assert time.time() - float((record_dir / "ending").read_text()) < REPORTED_WITHIN_S
    assert_nothing_left(record_dir, children=world_size)


def test_hanging_rank_times_out(record_dir):
    """The timeout may fall while the rank is still starting up: it is stopped all the same."""
    start = time.monotonic()
    with pytest.raises(DistributedLaunchError, match=r"timed out after 5 s: ranks \[0\] did not finish"):
        launch(launch_workers.misbehave, 1, args=(0, "hang", str(record_dir)), timeout_s=5.0)
    assert 5.0 <= time.monotonic() - start < 5.0 + REPORTED_WITHIN_S
    assert_nothing_left(record_dir, children=len(_children(record_dir)))


@pytest.mark.slow
def test_hanging_rank_and_its_waiting_peer_time_out_with_their_children(record_dir):
    start = time.monotonic()
    with pytest.raises(DistributedLaunchError, match=r"timed out after 30 s: ranks \[0, 1\] did not finish; "):
        launch(launch_workers.misbehave, 2, args=(1, "hang", str(record_dir)), timeout_s=30.0)
    assert 30.0 <= time.monotonic() - start < 30.0 + REPORTED_WITHIN_S
    assert_nothing_left(record_dir, children=2)


def test_children_end_with_a_successful_run(record_dir):
    children = launch(launch_workers.misbehave, 1, args=(-1, "", str(record_dir)), timeout_s=TIMEOUT_S)
    assert children == _children(record_dir)
    assert_nothing_left(record_dir, children=1)


def test_unpicklable_fn_or_args_is_refused_before_any_rank_starts():
    def local():
        pass

    cases = [(lambda: None, ()), (local, ()), (launch_workers.misbehave, (threading.Lock(),))]
    for fn, args in cases:
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"must be pickled.*(Can't pickle|cannot pickle).*module level"):
            launch(fn, 2, args=args)
        assert time.monotonic() - start < 1.0
        assert multiprocessing.active_children() == []


def test_fn_of_an_interactive_main_is_refused(monkeypatch):
    def fn():
        pass

    monkeypatch.setattr(fn, "__module__", "__main__")
    monkeypatch.delattr(sys.modules["__main__"], "__file__", raising=False)
    with pytest.raises(ValueError, match=r"fn is defined in an interactive __main__ \(no file\)"):
        launch(fn, 2)
    assert multiprocessing.active_children() == []


def test_rank_that_cannot_import_fn_dies_while_starting_up(monkeypatch):
    ghost = types.ModuleType("ascend_dsa_ghost_module")
    exec("def fn():\n    return 1\n", ghost.__dict__)
    monkeypatch.setitem(sys.modules, ghost.__name__, ghost)
    with pytest.raises(DistributedLaunchError, match=r"rank 0 died \(exit code 1\) while starting up, before fn"):
        launch(ghost.fn, 1, timeout_s=TIMEOUT_S)
    assert multiprocessing.active_children() == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        launch(launch_workers.misbehave, 0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        launch(launch_workers.misbehave, 1, timeout_s=0)

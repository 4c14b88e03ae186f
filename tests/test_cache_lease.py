"""Entry leases (npu_graph.cache.lease, npu_graph.cache.locks): one compiler per entry across processes and hosts.

A waiter sleeps, names the holder's host and pid, loads the entry as soon as it is stored, takes over a lease whose
heartbeat stopped (another host's: by the heartbeat alone) or whose holder ended on this machine (at once), never
breaks a lease that is being renewed, and gives up after its timeout with one warning.
"""
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
from cache_helpers import MODEL, isolated_key, one_cache_warning

from npu_graph.cache import lease as lease_module
from npu_graph.cache.disk_store import DiskCache
from npu_graph.cache.lease import break_lease, read_holder, try_take

own_key = isolated_key()
KEY = "ab" * 32
HOLDER = f"process {os.getpid()} on host {re.escape(socket.gethostname())}"


def _lease_record(path, host, pid, space, beat=0) -> None:
    with open(path, "w") as f:
        json.dump({"host": host, "pid": pid, "space": space, "start": "", "token": f"t{pid}", "beat": beat}, f)


def _timed_lock(disk: DiskCache) -> float:
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with disk.lock(KEY):
            holder = read_holder(disk.lease_path(KEY))
            assert holder is not None and holder.pid == os.getpid()     # the waiter holds it now
    assert read_holder(disk.lease_path(KEY)) is None                   # and gave it up
    return time.monotonic() - start


def test_a_held_lease_is_waited_for_with_a_status_line_naming_host_and_pid(tmp_path, capfd):
    disk = DiskCache(str(tmp_path), lock_timeout=30)
    held = disk.take_lease(KEY)
    threading.Timer(0.3, held.release).start()
    assert 0.2 < _timed_lock(disk) < 10
    err = capfd.readouterr().err
    assert re.search(f"waiting for {HOLDER}, which is compiling the same graph", err), err


def test_the_waiter_returns_as_soon_as_the_entry_is_stored(tmp_path):
    disk = DiskCache(str(tmp_path), lock_timeout=30)
    held = disk.take_lease(KEY)
    threading.Timer(0.3, os.mkdir, [disk.entry_dir(KEY)]).start()
    start = time.monotonic()
    assert disk.take_lease(KEY) is None
    assert time.monotonic() - start < 5
    assert read_holder(disk.lease_path(KEY)).token == held.token
    held.release()


def test_a_lease_held_past_the_timeout_warns_once_naming_the_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("ASCEND_DSA_CACHE_LOCK_TIMEOUT", "0.2")
    disk = DiskCache(str(tmp_path))
    held = disk.take_lease(KEY)
    try:
        with one_cache_warning(rf"waited 0.2 s for the lock of entry {KEY[:12]}, held by {HOLDER}; compiling this "
                               r"graph without waiting"), disk.lock(KEY):
            pass
    finally:
        held.release()
    for name in ("ASCEND_DSA_CACHE_LOCK_TIMEOUT", "ASCEND_DSA_CACHE_LEASE_STALE"):
        monkeypatch.setenv(name, "soon")
        with pytest.raises(ValueError, match=f"{name}='soon' is not a number of seconds"):
            DiskCache(str(tmp_path))
        monkeypatch.setenv(name, "0")
        with pytest.raises(ValueError, match=f"{name}='0' must be a positive number of seconds"):
            DiskCache(str(tmp_path))
        monkeypatch.delenv(name)


def test_another_hosts_lease_whose_heartbeat_stopped_is_taken_over(tmp_path):
    """A pid of another host says nothing here: only the heartbeat counts (this pid is alive on this host)."""
    disk = DiskCache(str(tmp_path), lock_timeout=30, lease_stale=0.5)
    _lease_record(disk.lease_path(KEY), "node-b", os.getpid(), "another-boot/pid:[1]")
    assert 0.5 <= _timed_lock(disk) < 5


def test_a_renewed_lease_is_not_taken_over(tmp_path):
    holder_side = DiskCache(str(tmp_path), lease_stale=0.5)       # renews every 0.1 s
    held = holder_side.take_lease(KEY)
    threading.Timer(1.5, held.release).start()
    waiter = DiskCache(str(tmp_path), lock_timeout=30, lease_stale=0.5)
    assert _timed_lock(waiter) >= 1.4
    assert held.beat >= 5


@pytest.mark.parametrize("ending", ["exited", "zombie"])
def test_a_lease_of_an_ended_process_of_this_machine_is_taken_at_once(tmp_path, ending):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    if ending == "exited":
        child.wait()
    else:
        while read_state(child.pid) != "Z":
            time.sleep(0.01)
    disk = DiskCache(str(tmp_path), lock_timeout=30, lease_stale=60)
    _lease_record(disk.lease_path(KEY), socket.gethostname(), child.pid, lease_module.process_space())
    assert _timed_lock(disk) < 2
    child.wait()


def read_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_holder_that_hangs_stops_renewing_after_its_bound(tmp_path):
    path = str(tmp_path / "x.lease")
    held = try_take(path, hold_s=0.3, every_s=0.05)
    time.sleep(0.5)
    last = read_holder(path).raw
    assert held.beat >= 2                                        # it was renewed ...
    time.sleep(0.5)
    assert held.lost and read_holder(path).raw == last           # ... and not after hold_s
    assert try_take(path, 10, 1) is None                         # still there until someone breaks it
    held.release()


def test_breaking_a_lease_renewed_meanwhile_puts_it_back(tmp_path):
    path = str(tmp_path / "x.lease")
    held = try_take(path, hold_s=60, every_s=60)
    seen = read_holder(path)
    held.renew()                                                  # the holder beat after the waiter looked
    break_lease(path, seen)
    assert read_holder(path).token == held.token and read_holder(path).raw != seen.raw
    break_lease(path, read_holder(path))                          # a lease that is what was seen is removed
    assert read_holder(path) is None
    assert not [name for name in os.listdir(tmp_path) if name != "x.lease"]
    held.release()


def test_a_lease_in_a_folder_without_hard_links_is_taken_by_exclusive_create(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(1, "Operation not permitted")
    monkeypatch.setattr(os, "link", no_links)
    path = str(tmp_path / "x.lease")
    held = try_take(path, 60, 60)
    assert held is not None and try_take(path, 60, 60) is None and read_holder(path).token == held.token
    held.release()
    assert os.listdir(tmp_path) == []


COMPILER = MODEL + textwrap.dedent("""
    import os, pathlib, sys, time, npu_graph, npu_graph.backend
    from npu_graph.cache import lease
    cache_dir, role = sys.argv[1], sys.argv[2]
    if role != "waiter":
        if role == "elsewhere":          # the lease says another host: only its heartbeat tells it is gone
            lease.process_space = lambda: "another-boot/pid:[1]"
        compile_graph = npu_graph.backend.capture_and_compile
        def stuck(*args, **kwargs):
            pathlib.Path(cache_dir, "compiling").touch()
            time.sleep(600)
        npu_graph.backend.capture_and_compile = stuck
    torch.manual_seed(0)
    m, x = Net(), torch.ones(4, 16)
    with torch.no_grad():
        out = torch.compile(m, backend="ascend_dsa", options={"cache_dir": cache_dir})(x)
        assert torch.allclose(out, m(x))
""")


@pytest.mark.parametrize(("where", "share"), [("elsewhere", "0"), ("elsewhere", "1"),
                                              pytest.param("here", "0", marks=pytest.mark.slow)])
def test_a_compiler_killed_mid_compile_hands_over_and_the_cache_verifies(tmp_path, monkeypatch, where, share):
    """The elected compiler is killed while it compiles; the waiter takes over (another host's lease: after its
    heartbeat stopped; one of this machine: at once), compiles and stores, and `cache verify` finds nothing wrong.
    With Dynamo's traces shared, the waiter waits on the trace's lease, which the killed process held too, then
    traces, compiles and stores both."""
    monkeypatch.setenv("ASCEND_DSA_SHARE_TRACES", share)
    monkeypatch.setenv("ASCEND_DSA_CACHE_LEASE_STALE", "2")
    monkeypatch.setenv("ASCEND_DSA_CACHE_LOCK_TIMEOUT", "120")
    cache = str(tmp_path / "cache")
    os.makedirs(cache, mode=0o700)
    run = [sys.executable, "-c", COMPILER, cache]
    elected = subprocess.Popen([*run, where], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    waiter_err = tmp_path / "waiter.err"
    try:
        _wait_for(lambda: os.path.exists(os.path.join(cache, "compiling")), elected)
        with open(waiter_err, "w") as err_file:
            waiter = subprocess.Popen([*run, "waiter"], stdout=subprocess.DEVNULL, stderr=err_file)
            _wait_for(lambda: "waiting for process" in waiter_err.read_text(), waiter)
            elected.kill()
            waiter.wait(timeout=300)
    finally:
        elected.kill()
        elected.wait()
    err = waiter_err.read_text()
    assert waiter.returncode == 0, err[-2000:]
    assert "CacheWarning" not in err, err[-2000:]
    verify = subprocess.run([sys.executable, "-m", "npu_graph", "cache", "verify", "--json", "--dir", cache],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stderr
    traces = {"traces": 1} if share == "1" else {}
    assert json.loads(verify.stdout) == {"ok": 1, "quarantined": [], "ignored": [], **traces}


def _wait_for(condition, process: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, f"exited with {process.returncode}"
        assert time.monotonic() < deadline
        time.sleep(0.1)

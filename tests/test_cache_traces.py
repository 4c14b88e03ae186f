"""Dynamo's traces shared through the compile cache (npu_graph.cache.traces): a process finds the trace another one
stored and does not trace; a trace that meets torch.distributed is kept per rank; a tampered trace is quarantined and
the function traced; settings that need Dynamo's graph (verify, dumps) trace in every process. Each run is a process
of its own (sharing switches torch's caching precompile on for the whole process)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
from cache_helpers import isolated_key

import npu_graph.backend
from npu_graph.cache import traces

own_key = isolated_key()

SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    import npu_graph.backend
    from npu_graph.cache import traces

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        def forward(self, x):
            y = self.b(torch.relu(self.a(x)))
            if RANKED:
                y = y * (2.0 if dist.is_initialized() else 1.0)      # torch.distributed, read while tracing
            return y.softmax(-1)

    cache_dir, options, RANKED = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "ranked"
    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model, backend="ascend_dsa", options={"cache_dir": cache_dir, **options})
    inputs = [torch.randn(4 + n, 16) for n in range(int(sys.argv[4]))]     # batch sizes 4, 5, ...
    with torch.no_grad():
        equal = all(torch.allclose(compiled(x), model(x)) for x in inputs)
    traces.settle()
    reports = npu_graph.backend.get_backend({"cache_dir": cache_dir, **options}).reports
    print(json.dumps({"equal": equal, "shared": any(r.extra.get("trace") == "shared" for r in reports)}))
""")


def _run(tmp_path, options=None, ranked=False, rank=0, wait=True, shapes=1, cache="cache"):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, ASCEND_DSA_SHARE_TRACES="1", RANK=str(rank), WORLD_SIZE="2")
    command = [sys.executable, str(script), str(tmp_path / cache), json.dumps(options or {}),
               "ranked" if ranked else "plain", str(shapes)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return _result(proc) if wait else proc


def _result(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["equal"], result
    return result, err


def _verify(tmp_path):
    run = subprocess.run([sys.executable, "-m", "npu_graph", "cache", "verify", "--json", "--dir",
                          str(tmp_path / "cache")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_a_second_process_loads_the_trace_and_a_tampered_one_is_quarantined(tmp_path):
    assert not _run(tmp_path)[0]["shared"]                   # traced, compiled, both stored
    assert _verify(tmp_path) == {"ok": 1, "quarantined": [], "ignored": [], "traces": 1}
    assert _run(tmp_path, shapes=2)[0]["shared"]             # loaded: no tracing, the graph from its entry;
    # then traced for another batch size, its guards failing (Dynamo names what it installs apart from the package's)
    assert _verify(tmp_path) == {"ok": 2, "quarantined": [], "ignored": [], "traces": 1}
    (folder,) = (tmp_path / "cache" / "v2" / "traces").iterdir()
    with open(folder / "trace.pkl", "ab") as f:
        f.write(b"\0")
    result, err = _run(tmp_path)
    assert not result["shared"]
    assert err.count("CacheWarning") == 1 and f"trace {folder.name[:12]} is not used" in err, err[-3000:]
    assert _verify(tmp_path)["traces"] == 1                  # traced again and stored again


def test_a_trace_that_meets_torch_distributed_is_kept_per_rank(tmp_path):
    assert not _run(tmp_path, ranked=True, rank=0)[0]["shared"]
    assert not _run(tmp_path, ranked=True, rank=1)[0]["shared"]   # rank 0's trace is not rank 1's
    assert _verify(tmp_path)["traces"] == 3                       # the marker and the two ranks' traces


@pytest.mark.slow
def test_processes_started_together_trace_once_and_a_rank_loads_its_own(tmp_path):
    procs = [_run(tmp_path, wait=False) for _ in range(2)]
    assert sorted(_result(proc)[0]["shared"] for proc in procs) == [False, True]
    assert not _run(tmp_path, ranked=True, rank=1, cache="ranked")[0]["shared"]
    assert _run(tmp_path, ranked=True, rank=1, cache="ranked")[0]["shared"]


def test_settings_that_need_dynamos_graph_are_not_shared():
    """Checking graphs against eager and dumping them need Dynamo's graph, which a loaded trace does not give."""
    assert traces.shareable(npu_graph.backend.get_backend({}))
    for options in ({"verify": True}, {"dump_dir": "/nonexistent/dump"}):
        assert not traces.shareable(npu_graph.backend.get_backend(options)), options
    assert not traces.shareable(npu_graph.backend.get_backend({"cache": False}))


def test_sharing_is_on_under_torchrun_or_when_asked(monkeypatch):
    monkeypatch.delenv("ASCEND_DSA_SHARE_TRACES", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not traces.sharing_requested()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert traces.sharing_requested()
    monkeypatch.setenv("ASCEND_DSA_SHARE_TRACES", "0")
    assert not traces.sharing_requested()
    monkeypatch.setenv("ASCEND_DSA_SHARE_TRACES", "yes")
    with pytest.raises(ValueError, match="ASCEND_DSA_SHARE_TRACES='yes': use 1"):
        traces.sharing_requested()

"""A warm start of plain torch.compile(model, backend="ascend_dsa"): with torch's caching precompile switched on
(TORCH_CACHING_PRECOMPILE=1), a new process whose compile cache holds the model's trace neither traces with Dynamo
nor compiles, and gives the cold process's numbers, graph breaks included."""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "warm_start.py")


def _run(cache_dir: str, *args: str, **env: str) -> tuple[dict, str]:
    env = dict(os.environ, ASCEND_DSA_CACHE_DIR=cache_dir, **env)
    env.pop("ASCEND_DSA_SHARE_TRACES", None)
    done = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize("model", ["broken_mlp", pytest.param("hybrid", marks=pytest.mark.slow)])
def test_a_warm_process_neither_traces_nor_compiles(tmp_path, model):
    cold, _ = _run(str(tmp_path), model, TORCH_CACHING_PRECOMPILE="1")
    warm, err = _run(str(tmp_path), model, TORCH_CACHING_PRECOMPILE="1")
    assert cold["traced"] >= 2 and cold["from_dynamo"] >= 2 and cold["loaded"] == 0     # a graph break: two frames
    assert warm["traced"] == 0 and warm["from_dynamo"] == 0 and warm["loaded"] == cold["from_dynamo"]
    assert warm["sum"] == cold["sum"]
    assert abs(warm["sum"] - warm["eager"]) < 1e-3 * max(1.0, abs(warm["eager"]))
    assert "Warning" not in err, err[-3000:]
    off, _ = _run(str(tmp_path), model)        # without the switch: the graphs come from the cache, traced
    assert off["traced"] >= 2 and off["loaded"] == 0 and off["sum"] == cold["sum"]


GRAD = """
import torch, npu_graph
from npu_graph.cache import traces
compiled = torch.compile(torch.nn.Linear(8, 8), backend="ascend_dsa")
for _ in range(2):
    compiled(torch.ones(2, 8)).sum().backward()      # with autograd: a graph the compile cache does not keep
traces.settle()
"""


def test_the_switch_set_in_code_works_and_a_trace_that_cannot_be_kept_warns_once(tmp_path):
    _run(str(tmp_path), "broken_mlp", "code")
    assert _run(str(tmp_path), "broken_mlp", "code")[0]["traced"] == 0
    env = dict(os.environ, ASCEND_DSA_CACHE_DIR=str(tmp_path), TORCH_CACHING_PRECOMPILE="1")
    env.pop("ASCEND_DSA_SHARE_TRACES", None)
    done = subprocess.run([sys.executable, "-c", GRAD], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("TraceNotStoredWarning") == 1, done.stderr[-3000:]
    assert "is not kept in the compile cache (its graph __compiled_fn" in done.stderr


def test_a_kept_trace_torch_cannot_install_is_traced_with_one_warning():
    """torch recovers from a RuntimeError of install by tracing; whatever rebuilding a guard raises becomes one."""
    from npu_graph.cache import traces

    class Package:
        _initialized = True

        def install(self, backends):
            raise AttributeError("'_Missing' object has no attribute '__defaults__'")

    class Shelf:
        def __init__(self):
            self.written = []

        def write(self, key, package, meta):
            self.written.append((key, package, meta))

    package, shelf = Package(), Shelf()
    traces._install_or_refuse(package, "m.f", shelf, "k" * 64)
    with pytest.warns(traces.TraceNotLoadedWarning, match=r"m\.f kept in the compile cache cannot be loaded .*"
                      r"AttributeError.*traced as without a warm cache"), \
            pytest.raises(RuntimeError, match=r"kept trace of m\.f not loaded"):
        package.install({})
    assert not package._initialized and "install" not in vars(package)
    assert shelf.written == [("k" * 64, None, {"unloadable": "AttributeError: '_Missing' object has no attribute "
                                                               "'__defaults__'", "function": "m.f"})]


def test_a_trace_marked_unloadable_is_traced_at_once_and_not_stored_again(tmp_path):
    """The next process finds the marker: no package to try, no lease taken, nothing left to store."""
    import npu_graph
    from npu_graph.cache import trace_pending, traces
    from npu_graph.cache.trace_store import TraceShelf

    def fn(x):
        return x + 1

    backend = npu_graph.Backend(npu_graph.CompilerConfig.from_options({"cache_dir": str(tmp_path)}))
    shelf = TraceShelf(backend.cache.disk)
    key = traces.trace_key(fn, backend.config.key())
    assert shelf.write(key, None, {"unloadable": "AttributeError: x", "function": "fn"})
    pending = dict(trace_pending.STATE.pending)
    assert traces.open_trace(fn, backend, object()) is None
    assert trace_pending.STATE.pending == pending
    assert not os.path.exists(os.path.join(shelf.disk.base, "locks", f"trace-{key}.lease"))
    assert shelf.read(key)[0]["unloadable"] == "AttributeError: x"

"""cpu.glue="auto": a graph worth Inductor's glue runs its Python form first while the glue worker process compiles
Inductor's (npu_graph.runtime.glue_upgrade / glue_worker); the graph switches at a later call, the report, the dump
and the cache entry say what then runs, and a compile that adds shape guards or fails leaves the Python glue."""
import json
import os

import pytest
import torch

import npu_graph
from npu_graph.runtime import glue_upgrade, glue_worker, inductor_glue, size_guards


def _norm_chain(x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """An RMSNorm the passes fuse between small elementwise ops, scaled by a fused causal_lengths call."""
    _, lengths, _ = torch.ops.ascend_dsa.causal_lengths(mask)
    for _ in range(2):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        x = (torch.sigmoid(x) + x * 0.5).relu()
    return x * lengths.float().sum()


ARGS = (torch.randn(4, 4, 32), torch.randn(32), torch.ones(1, 4, 4, dtype=torch.bool).tril())


@pytest.fixture
def worth_it(monkeypatch):
    """Every graph is worth Inductor's glue under "auto" (the small test graph would not be)."""
    monkeypatch.setattr(inductor_glue, "MIN_GLUE_NODES", 1)


def _backend(tmp_path, **options) -> npu_graph.Backend:
    torch._dynamo.reset()
    return npu_graph.Backend(npu_graph.CompilerConfig.from_options(
        {"cpu_glue": "auto", "cache_dir": str(tmp_path / "cache"), "dump_dir": str(tmp_path / "dump"), **options}))


def _run(backend: npu_graph.Backend) -> torch.Tensor:
    with torch.no_grad():
        return torch.compile(_norm_chain, backend=backend)(*ARGS)


def _stored_glue(tmp_path) -> str | None:
    """The glue of the one entry in the test's cache (None when there is none)."""
    found = list((tmp_path / "cache").rglob("meta.json"))
    assert len(found) <= 1, found
    return json.loads(found[0].read_text())["summary"]["runtime"]["glue"] if found else None


def _runtime(tmp_path) -> dict:
    (path,) = (tmp_path / "dump").glob("*/summary.json")
    return json.loads(path.read_text())["runtime"]


def test_python_glue_first_then_inductor_from_the_worker_and_the_cache(tmp_path, worth_it):
    backend = _backend(tmp_path)
    compiled = torch.compile(_norm_chain, backend=backend)
    with torch.no_grad():
        expected = _norm_chain(*ARGS)
        torch.testing.assert_close(compiled(*ARGS), expected)
        runtime = _runtime(tmp_path)
        assert runtime["glue"] == "python" and "ATen calls" in runtime["glue_reason"], runtime
        assert _stored_glue(tmp_path) == "python", "not stored at once with the Python glue"
        assert glue_upgrade.wait_all(timeout=600)
        assert _stored_glue(tmp_path) == "inductor", "not replaced when the glue landed"
        torch.testing.assert_close(compiled(*ARGS), expected, rtol=1e-5, atol=1e-5)
    runtime = _runtime(tmp_path)
    assert runtime["glue"] == "inductor", runtime
    assert "compiled in the background" in runtime["glue_reason"] and runtime["glue_calls_before"] == 1, runtime
    (source,) = (tmp_path / "dump").glob("*/compiled.py")
    assert "GLUE = 'inductor'" in source.read_text() and "_ascend_dsa_direct_causal_lengths(" in source.read_text()
    hit = _backend(tmp_path, dump_dir=None)
    torch.testing.assert_close(_run(hit), expected, rtol=1e-5, atol=1e-5)
    assert hit.reports[0].cache == "hit" and hit.reports[0].extra["runtime"]["glue"] == "inductor"
    dumped = _backend(tmp_path, dump_dir=str(tmp_path / "hit_dump"))   # a hit's dump compiles again, glue included
    torch.testing.assert_close(_run(dumped), expected, rtol=1e-5, atol=1e-5)
    assert dumped.reports[0].cache == "hit" and dumped.reports[0].extra["dump_matches_entry"], dumped.reports[0].extra


def test_a_graph_that_runs_once_is_stored_with_its_python_glue(tmp_path, worth_it):
    """A script that calls its compiled function once never starts the background compile (it starts at a graph's
    second call): the entry stored at once, with the Python glue, is what the next process hits."""
    expected = _norm_chain(*ARGS)
    torch.testing.assert_close(_run(_backend(tmp_path)), expected)
    assert _stored_glue(tmp_path) == "python"
    hit = _backend(tmp_path, dump_dir=None)
    torch.testing.assert_close(_run(hit), expected, rtol=1e-5, atol=1e-5)
    assert hit.reports[0].cache == "hit" and hit.reports[0].extra["runtime"]["glue"] == "python"


@pytest.mark.parametrize("reply, reason", [
    ({"source": "", "guards": ["Eq(s0, 4)"]}, "added shape guards (Eq(s0, 4)) that Dynamo no longer checks and this "
                                              "graph cannot check (the guards read sizes no input carries: ['s0'])"),
    ({"error": "RuntimeError: no C++ compiler"}, "Inductor could not take the graph (RuntimeError: no C++"),
])
def test_a_compile_that_adds_guards_or_fails_keeps_the_python_glue(tmp_path, worth_it, monkeypatch, reply, reason):
    monkeypatch.setattr(glue_worker.WORKER, "compile", lambda payload: reply)
    backend = _backend(tmp_path)
    compiled = torch.compile(_norm_chain, backend=backend)
    with torch.no_grad():
        compiled(*ARGS)
        assert glue_upgrade.wait_all(timeout=60)
        torch.testing.assert_close(compiled(*ARGS), _norm_chain(*ARGS))
    runtime = _runtime(tmp_path)
    assert runtime["glue"] == "python" and reason in runtime["glue_reason"], runtime
    assert backend.reports[0].cache == "miss"


def test_a_graph_that_cannot_be_pickled_keeps_the_python_glue(tmp_path, worth_it, monkeypatch):
    def refuse(gm):
        raise TypeError("cannot pickle 'generator' object")
    monkeypatch.setattr(glue_worker, "pickled_graph", refuse)
    backend = _backend(tmp_path)
    compiled = torch.compile(_norm_chain, backend=backend)
    with torch.no_grad():
        compiled(*ARGS)
        compiled(*ARGS)
    assert "cannot be sent to the glue worker (TypeError" in _runtime(tmp_path)["glue_reason"]


def test_the_worker_reports_a_graph_it_cannot_read():
    reply = glue_worker.WORKER.compile(b"not a pickled graph")
    assert "error" in reply and "UnpicklingError" in reply["error"], reply


def test_guards_the_compile_adds_are_checked_by_the_graph_and_kept_by_the_cache(tmp_path, worth_it, monkeypatch):
    """Inductor's compile of a symbolic graph may add a shape guard after Dynamo installed its own (Kimi Linear's
    decode graph: s6 + 1 <= 4096): Inductor's glue runs where it holds, the Python glue elsewhere, and the cache
    entry carries it as a guard of its own. Here the worker's reply gets one more: rows <= 5."""
    rows = []                                 # the symbol of x's first dimension, as the graph's inputs carry it
    sources_of = size_guards.symbol_sources

    def sources_noting_rows(values):
        rows.extend(str(v.shape[0].node.expr) for v in values
                    if isinstance(v, torch.Tensor) and v.dim() == 3 and isinstance(v.shape[0], torch.SymInt))
        return sources_of(values)

    real = glue_worker.WORKER.compile
    monkeypatch.setattr(size_guards, "symbol_sources", sources_noting_rows)
    monkeypatch.setattr(glue_worker.WORKER, "compile",
                        lambda payload: (lambda reply: {**reply, "guards": [*reply["guards"], f"{rows[0]} <= 5"]})(
                            real(payload)))
    checked, check = [], size_guards.guard_check

    def noted_check(guards, sources):
        holds = check(guards, sources)
        return lambda inputs: checked.append(holds(inputs)) or checked[-1]

    monkeypatch.setattr(size_guards, "guard_check", noted_check)
    backend = _backend(tmp_path, cpu_glue="background")      # "auto" compiles a symbolic graph's glue at once
    compiled = torch.compile(_norm_chain, backend=backend, dynamic=True)
    small, large = (torch.randn(5, 4, 32), *ARGS[1:]), (torch.randn(6, 4, 32), *ARGS[1:])
    with torch.no_grad():
        compiled(*small)
        assert glue_upgrade.wait_all(timeout=600)
        for args in (small, large):
            torch.testing.assert_close(compiled(*args), _norm_chain(*args), rtol=1e-5, atol=1e-5)
    runtime = backend.reports[0].extra["runtime"]
    assert checked == [True, False] and len(backend.reports) == 1, (checked, runtime)
    assert "runs where its shape guards (" in runtime["glue_reason"] and f"{rows[0]} <= 5)" in runtime["glue_reason"]
    hit = _backend(tmp_path, dump_dir=None, cpu_glue="background")
    with torch.no_grad():
        torch.compile(_norm_chain, backend=hit, dynamic=True)(*small)
    assert hit.reports[0].cache == "hit" and hit.reports[0].extra["runtime"]["glue"] == "inductor"


def test_guard_check_reads_symints_and_sizes():
    sources = {"s0": ["size", 0, 1], "s1": ["symint", 1]}
    check = size_guards.guard_check(["s0 + 1 <= 8", "Eq(Mod(s1, 2), 0)"], sources)
    assert check([torch.empty(2, 7), 4]) and not check([torch.empty(2, 8), 4]) and not check([torch.empty(2, 3), 5])
    with pytest.raises(ValueError, match="no input carries"):
        size_guards.guard_check(["s2 < 4"], sources)
    with pytest.raises(ValueError, match="cannot evaluate"):
        size_guards.guard_check(["Eq(FloorDiv(s0, 2), 1)"], sources)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_process_gets_a_worker_of_its_own():
    """A fork (a data loader's worker, say) must not write to its parent's pipes, nor kill its parent's worker."""
    assert "error" in glue_worker.WORKER.compile(b"x")          # the parent's worker is running
    parents, parent_pid = glue_worker.WORKER._process, os.getpid()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            reply = glue_worker.WORKER.compile(b"y")
            glue_worker.WORKER._stop(parents, parent_pid)    # what the fork's exit runs: not its worker
            code = 0 if "error" in reply and glue_worker.WORKER._process is not parents else 1
            glue_worker.WORKER._stop(glue_worker.WORKER._process, os.getpid())
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert parents.poll() is None and "error" in glue_worker.WORKER.compile(b"z")


def test_a_compile_queued_at_exit_starts_no_new_worker():
    """At exit the worker is stopped while other graphs' compile threads may still wait for it: they get an error,
    not a new child that would outlive the process (and print a broken pipe when it replies)."""
    worker = glue_worker.GlueWorker()
    worker.warm()
    first = worker._process
    worker._stop(first, os.getpid())               # what the process's exit runs
    reply = worker.compile(b"queued")
    assert reply == {"error": "the process is exiting"} and worker._process is first and first.poll() is not None


def test_auto_compiles_a_symbolic_graphs_glue_with_the_graph(tmp_path, worth_it, monkeypatch):
    """Under "auto" the graph Dynamo made for every later size runs Inductor's glue from its first call where its
    Python glue would make many calls; a static graph starts on its Python glue (the test above)."""
    monkeypatch.setattr(inductor_glue, "NOW_MIN_GLUE_NODES", 1)
    backend = _backend(tmp_path)
    compiled = torch.compile(_norm_chain, backend=backend, dynamic=True)
    with torch.no_grad():
        for rows in (5, 6):
            args = (torch.randn(rows, 4, 32), *ARGS[1:])
            torch.testing.assert_close(compiled(*args), _norm_chain(*args), rtol=1e-5, atol=1e-5)
    runtime = backend.reports[0].extra["runtime"]
    assert len(backend.reports) == 1 and runtime["glue"] == "inductor", runtime
    assert "symbolic sizes" in runtime["glue_reason"] and "compiled with the graph" in runtime["glue_reason"]


def test_auto_keeps_the_python_glue_where_inductor_cannot_take_a_symbolic_graph(tmp_path, worth_it, monkeypatch):
    monkeypatch.setattr(inductor_glue, "NOW_MIN_GLUE_NODES", 1)

    def refuse(gm):
        raise inductor_glue.GlueUnsupported("outputs of kind ['alias_of_input'] are rebuilt")

    monkeypatch.setattr(inductor_glue, "compile_forward", refuse)
    backend = _backend(tmp_path)
    args = (torch.randn(5, 4, 32), *ARGS[1:])
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(_norm_chain, backend=backend, dynamic=True)(*args),
                                   _norm_chain(*args), rtol=1e-5, atol=1e-5)
    runtime = backend.reports[0].extra["runtime"]
    assert runtime["glue"] == "python" and "Inductor could not take it (GlueUnsupported" in runtime["glue_reason"]


def test_a_symbolic_graph_of_few_calls_compiles_in_the_background(tmp_path, worth_it):
    backend = _backend(tmp_path)
    with torch.no_grad():
        torch.compile(_norm_chain, backend=backend, dynamic=True)(torch.randn(5, 4, 32), *ARGS[1:])
    runtime = backend.reports[0].extra["runtime"]
    assert runtime["glue"] == "python" and "symbolic sizes" not in runtime["glue_reason"], runtime
    assert glue_upgrade.wait_all(timeout=600)


@pytest.mark.parametrize("glue,worth,starts", [("auto", True, True), ("auto", False, False), ("python", True, False)])
def test_a_hit_on_inductors_glue_starts_the_vec_isa_check(tmp_path, monkeypatch, glue, worth, starts):
    """A warm process loads its graphs from the cache: the check an entry with Inductor's glue needs overlaps the
    tracing; entries that run their Python glue do not start it."""
    if worth:
        monkeypatch.setattr(inductor_glue, "MIN_GLUE_NODES", 1)
    compiled = torch.compile(_norm_chain, backend=_backend(tmp_path, cpu_glue=glue))
    with torch.no_grad():
        compiled(*ARGS)
        compiled(*ARGS)                                     # the glue compile starts at a second call
    glue_upgrade.wait_all(timeout=600)
    started = []
    monkeypatch.setattr(inductor_glue, "warm_vec_isa", lambda: started.append(True))
    _run(_backend(tmp_path, cpu_glue=glue))                 # a new backend on the same cache folder: a hit
    assert bool(started) == starts


def test_a_graph_with_inductor_glue_waits_for_the_check_in_flight(monkeypatch):
    """Inductor's list is cached but not locked: loading beside the check's thread would run it twice."""
    from npu_graph.runtime import compiled_graph
    joined = []
    monkeypatch.setattr(inductor_glue, "vec_isa_checked", lambda: joined.append(True))
    source = inductor_glue.GLUE_LINE + "def forward(self, *inputs):\n    return inputs\n"
    assert compiled_graph.CompiledGraph("g", source, {}, {}).glue == "inductor" and joined == [True]
    compiled_graph.CompiledGraph("g", "def forward(self, *inputs):\n    return inputs\n", {}, {})
    assert joined == [True]

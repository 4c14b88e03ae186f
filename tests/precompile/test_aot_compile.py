"""A program AOT-compiled with ascend_dsa (torch.compile(...).forward.aot_compile) saves, and loads in a new process
that neither traces with Dynamo nor compiles, giving the same numbers; the serialized form refuses another
compiler version and a graph that has no artifact."""
import json
import os
import subprocess
import sys

import pytest
import torch

from npu_graph.cache import precompiled
from npu_graph.cache.entry import Artifact

SCRIPT = os.path.join(os.path.dirname(__file__), "aot_roundtrip.py")


def _run(action: str, path: str, model: str, cache_dir: str) -> dict:
    env = dict(os.environ, ASCEND_DSA_CACHE_DIR=cache_dir)
    done = subprocess.run([sys.executable, SCRIPT, action, path, model], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["mlp", pytest.param("hybrid", marks=pytest.mark.slow)])
def test_saved_program_loads_without_tracing_or_compiling(tmp_path, model):
    path = str(tmp_path / "program.bin")
    cold = _run("save", path, model, str(tmp_path / "cache"))
    warm = _run("load", path, model, str(tmp_path / "other_cache"))     # the program alone carries the graph
    assert cold["traced"] >= 1 and cold["compiled"] >= 1
    assert warm["traced"] == 0 and warm["compiled"] == 0
    assert warm["sum"] == cold["sum"]
    assert abs(warm["sum"] - warm["eager"]) < 1e-3 * max(1.0, abs(warm["eager"]))


def _artifact() -> Artifact:
    source = "def forward(self, x):\n    return (x + 1,)\n"
    return Artifact(source, [], {}, [], [], {})


def test_round_trip_of_the_serialized_form_runs_the_graph():
    data = precompiled.PrecompiledGraph.serialize_compile_artifacts(
        precompiled.PrecompiledGraph(lambda *a: None, "g", _artifact()))
    loaded = precompiled.PrecompiledGraph.deserialize_compile_artifacts(data)
    assert torch.equal(loaded(torch.ones(2))[0], torch.full((2,), 2.0))


def test_another_compiler_version_is_refused(monkeypatch):
    data = precompiled.serialized("g", _artifact(), "")
    monkeypatch.setattr(precompiled, "source_digest", lambda: "another")
    with pytest.raises(precompiled.NotSerializable, match="another version"):
        precompiled.deserialized(data)


def test_damaged_bytes_are_refused():
    data = precompiled.serialized("g", _artifact(), "")
    with pytest.raises(precompiled.NotSerializable, match="damaged"):
        precompiled.deserialized(data[:-3])


def test_a_graph_without_artifact_says_why_it_cannot_be_saved():
    graph = precompiled.PrecompiledGraph(lambda *a: None, "graph_3", None, "graph needs autograd")
    with pytest.raises(precompiled.NotSerializable, match="graph_3 cannot be serialized: graph needs autograd"):
        precompiled.PrecompiledGraph.serialize_compile_artifacts(graph)

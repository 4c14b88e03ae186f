"""`ascend-dsa inspect` on a real dump of the reference model: the graph table, one stage, the diff between
stages, `--json` output through the real command, the errors, the structured trace, and that a failing
dump never stops compilation."""
import json
import logging
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
from reference_dump import build_reference_dump

import npu_graph
import npu_graph.observe.dump
import npu_graph.observe.trace
from npu_graph.tools import cli, inspect_dump


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    return build_reference_dump(tmp_path_factory)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "npu_graph", "inspect", *args], capture_output=True, text=True,
                          timeout=300)


def run_json(*args):
    p = run_cli(*args, "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_graph_table_json(dump):
    data = run_json(dump)
    assert data["dump"] == os.path.abspath(dump)
    [graph] = data["graphs"]
    assert graph["folder"].startswith("000_graph_0_") and graph["graph"] == "graph_0"
    assert graph["nodes_before"] > graph["nodes_after"] > 100
    assert graph["cache"] == "bypass" and graph["compile_ms"] > 0 and graph["fallback"] is None
    assert "canonicalize" in graph["passes_changed"] and graph["complete"]


def test_stage_json_by_name_and_by_number(dump):
    stage = run_json(dump, "--graph", "graph_0", "--pass", "canonicalize")
    summary = inspect_dump.read_json(os.path.join(dump, stage["folder"], "summary.json"))
    assert stage["stage"] == "canonicalize" and stage["index"] == 3     # after vllm_ops and canonical_form
    canonical = next(p for p in summary["passes"] if p["name"] == "canonicalize")
    assert "def forward" in stage["text"] and len(stage["nodes"]) == canonical["nodes"]
    node = stage["nodes"][-1]
    assert {"name", "op", "target", "args", "kwargs", "shapes", "dtypes", "created_by"} <= node.keys()
    captured = inspect_dump.show_stage(dump, "0", "0")
    assert captured["stage"] == "captured" and len(captured["nodes"]) == summary["nodes_before"]


def test_diff_json_matches_the_stages(dump):
    d = run_json("diff", dump, "canonical_form", "canonicalize", "--graph", "0")
    before = inspect_dump.show_stage(dump, None, "canonical_form")["nodes"]
    after = {n["name"] for n in inspect_dump.show_stage(dump, None, "canonicalize")["nodes"]}
    assert d["from"] == "canonical_form" and d["to"] == "canonicalize" and d["passes"] == ["canonicalize"]
    assert len(d["removed"]) - len(d["added"]) == d["nodes_before"] - d["nodes_after"] > 0
    assert all(n["name"] not in after for n in d["removed"])
    assert {n["name"] for n in d["removed"]} <= {n["name"] for n in before}
    assert d["rewired"], "removing view chains rewires their users"


def test_a_near_miss_shows_its_canonical_expression_and_what_differs(tmp_path):
    """A lightning indexer with gelu where the pattern has relu: the graph's stages list the near miss with the
    canonical expression at the top-k and the first term that is not the pattern's."""
    from npu_graph.tools.fusion_spellings import family

    spelling = next(n for n in family("indexer").negatives if n.name == "gelu").build()
    with torch.no_grad():
        torch.compile(spelling.module, backend="ascend_dsa",
                      options={"cache": False, "dump_dir": str(tmp_path)})(*spelling.inputs)
    data = run_json(str(tmp_path), "--graph", "0")
    [miss] = [m for m in data["near_misses"] if m["pass"] == "fuse_lightning_indexer"]
    assert "gelu(" in miss["canonical"] and "Σ[" in miss["canonical"]
    assert miss["differs"] == "gelu(q·k) where the pattern has relu(q·k)"
    text = run_cli(str(tmp_path), "--graph", "0").stdout
    assert "near miss of fuse_lightning_indexer" in text and "canonical:" in text and "differs:" in text


def test_diff_finds_fused_regions_and_rewired_nodes():
    node = lambda name, target, args=(), by="capture": {  # noqa: E731
        "name": name, "op": "call_function", "target": target, "args": list(args), "kwargs": {},
        "created_by": by}
    before = {"stage": "captured", "nodes": [node("x", "x"), node("relu", "aten.relu.default", ["x"]),
                                             node("topk", "aten.topk.default", ["relu"]),
                                             node("out", "output", ["topk"])]}
    after = {"stage": "fuse_indexer", "nodes": [
        node("x", "x"), node("indexer", "ascend_dsa.lightning_indexer.default", ["x"], "fuse_indexer"),
        node("getitem", "getitem", ["indexer", "0"], "fuse_indexer"), node("out", "output", ["getitem"])]}
    d = inspect_dump.diff_stages(before, after, ["fuse_indexer"])
    assert [n["name"] for n in d["removed"]] == ["relu", "topk"]
    assert [n["name"] for n in d["added"]] == ["indexer", "getitem"]
    assert [n["name"] for n in d["rewired"]] == ["out"]
    [region] = d["fused_regions"]
    assert region["pass"] == "fuse_indexer" and [n["fused"] for n in region["nodes"]] == [True, False]
    assert d["fused_ops"] == {"ascend_dsa.lightning_indexer.default": {"before": 0, "after": 1}}


def test_table_and_stage_text(dump, capsys):
    assert cli.main(["inspect", dump]) == 0
    out = capsys.readouterr().out
    assert "000_graph_0_" in out and "not planned" in out and "bypass" in out
    assert cli.main(["inspect", dump, "--graph", "0", "--pass", "captured"]) == 0
    assert capsys.readouterr().out.startswith("class ")


@pytest.mark.parametrize("args, expected", [
    (["/no/such/dump"], ["no dump folder", "/no/such/dump"]),
    (["{dump}", "--graph", "nope"], ["graph 'nope' is unknown", "000_graph_0_", "graph_0"]),
    (["{dump}", "--graph", "0", "--pass", "nope"], ["pass 'nope' is unknown", "captured", "canonicalize"]),
    (["diff", "{dump}", "captured", "nope"], ["pass 'nope' is unknown", "canonicalize"]),
])
def test_errors_name_what_exists(dump, capsys, args, expected):
    argv = ["inspect", *(a.format(dump=dump) for a in args), "--json"]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert all(text in captured.err for text in expected), captured.err


def test_error_exit_code_from_the_command(dump):
    p = run_cli(dump, "--graph", "7", "--pass", "captured", "--json")
    assert p.returncode == 2 and p.stdout == "" and "graph '7' is unknown" in p.stderr


def test_a_graph_folder_is_a_dump_too(dump):
    [graph] = inspect_dump.find_graphs(dump)
    assert inspect_dump.overview(graph["path"])["graphs"][0]["folder"] == graph["folder"]


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_dump_failing_midway_still_compiles_and_runs(tmp_path, monkeypatch, caplog):
    failing = []

    def dumps_then_fail(obj, **kwargs):  # every JSON after the captured stage's fails
        if isinstance(obj, dict) and obj.get("stage", "captured") != "captured":
            failing.append(1)
        if failing:
            raise ValueError("disk on fire")
        return json.dumps(obj, **kwargs)

    monkeypatch.setattr(npu_graph.observe.dump, "json", types.SimpleNamespace(dumps=dumps_then_fail))
    model, x = MLP(), torch.randn(3, 8)
    backend = npu_graph.get_backend({"cache": False, "dump_dir": str(tmp_path)})
    before = len(backend.reports)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="npu_graph"), torch.no_grad():
        warnings.simplefilter("error")
        out = torch.compile(model, backend=backend)(x)
        torch.testing.assert_close(out, model(x))
    assert [r.fallback for r in backend.reports[before:]] == [None]
    assert "disk on fire" in caplog.text
    [folder] = tmp_path.iterdir()
    written = {p.name for p in folder.iterdir()}
    assert {"00_captured.json", "00_captured.txt", "01_vllm_ops.txt", "compiled.py"} <= written
    assert "01_vllm_ops.json" not in written and "summary.json" not in written


def test_structured_trace_carries_every_stage(monkeypatch):
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    trace_log = torch._logging._internal.trace_log
    handler = Keep()
    trace_log.addHandler(handler)
    try:
        with torch.no_grad():
            torch.compile(MLP(), backend="ascend_dsa", options={"cache": False})(torch.randn(2, 8))
        torch._dynamo.reset()
        monkeypatch.setattr(npu_graph.observe.trace, "trace_structured", lambda *a, **k: 1 / 0)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error")
            torch.compile(MLP(), backend="ascend_dsa", options={"cache": False})(torch.randn(2, 8))
    finally:
        trace_log.removeHandler(handler)
    artifacts = {r.metadata["artifact"]["name"]: r.payload for r in records
                 if "artifact" in getattr(r, "metadata", {})}
    assert {"ascend_dsa_captured", "ascend_dsa_canonicalize", "ascend_dsa_compiled_py"} <= artifacts.keys()
    assert "def forward" in artifacts["ascend_dsa_canonicalize"]

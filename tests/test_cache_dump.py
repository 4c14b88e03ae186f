"""Dumps of graphs the compile cache serves: as complete as a compiled graph's, saying where the graph came from,
in folders named with Dynamo's compile id."""
import json
import logging
import os

import torch
from cache_helpers import compile_once, isolated_key

from npu_graph import backend as backend_module
from npu_graph.observe import dump as dump_module
from npu_graph.observe.report import GraphReport

own_key = isolated_key()


def graph_folders(dump_dir):
    return sorted(p for p in dump_dir.iterdir() if p.is_dir())


def summary_of(folder):
    return json.loads((folder / "summary.json").read_text())


def test_a_hit_writes_the_same_dump_as_the_compile_and_says_it_came_from_the_cache(tmp_path):
    first, out1 = compile_once(tmp_path / "cache", dump_dir=str(tmp_path / "compiled"))
    second, out2 = compile_once(tmp_path / "cache", dump_dir=str(tmp_path / "loaded"))
    assert (first.cache, second.cache) == ("miss", "hit") and torch.equal(out1, out2)
    [compiled], [loaded] = graph_folders(tmp_path / "compiled"), graph_folders(tmp_path / "loaded")
    files = {p.name for p in compiled.iterdir()}
    assert len(files) > 10 and {"00_captured.json", "compiled.py", "summary.json"} <= files
    assert {p.name for p in loaded.iterdir()} == files
    assert (loaded / "compiled.py").read_text() == (compiled / "compiled.py").read_text()
    made, hit = summary_of(compiled), summary_of(loaded)
    assert (made["source"], made["cache"]) == ("compiled", "miss")
    assert (hit["source"], hit["cache"], hit["dump_matches_entry"]) == ("cache", "hit", True)
    assert made["cache_key"] == hit["cache_key"] and len(hit["cache_key"]) == 64
    assert made["compile_id"] == "0/0" and compiled.name == f"000_graph_0_c0-0_{os.getpid()}"
    assert [p["name"] for p in hit["passes"]] == [p["name"] for p in made["passes"]]
    assert hit["fused_ops"] == made["fused_ops"]


def test_a_hit_without_a_dump_names_its_entry_and_with_one_still_runs_the_entry(tmp_path, monkeypatch):
    compile_once(tmp_path / "cache")
    report, _ = compile_once(tmp_path / "cache")
    assert report.cache == "hit" and report.dump_folder is None
    assert report.extra["source"] == "cache" and report.extra["compile_id"] == "0/0"
    assert len(report.extra["cache_key"]) == 64
    ran = []
    real_load = backend_module.CompileCache._load

    def load_and_mark(self, key, gm, example_inputs):
        found = real_load(self, key, gm, example_inputs)
        if found.decision == "hit":
            entry = found.callable
            found.callable = lambda *args: ran.append(key) or entry(*args)
        return found

    monkeypatch.setattr(backend_module.CompileCache, "_load", load_and_mark)
    report, _ = compile_once(tmp_path / "cache", dump_dir=str(tmp_path / "dump"))
    assert report.cache == "hit" and ran and report.extra["source"] == "cache"


def test_dump_folder_names_carry_the_compile_id_after_the_creation_order():
    assert dump_module.folder_name(7, "graph_3", "1/2_1") == f"007_graph_3_c1-2_1_{os.getpid()}"
    assert dump_module.folder_name(0, "graph_0", None) == f"000_graph_0_{os.getpid()}"


def test_a_recompiled_dump_that_differs_from_its_entry_keeps_both_and_warns(tmp_path, caplog):
    report = GraphReport(name="graph_0", inference=True, target="cpu", dump_folder=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="npu_graph"):
        dump_module.dump_matches_entry(report, "new code", "entry code")
    assert report.extra["dump_matches_entry"] is False and "other code" in caplog.text
    assert (tmp_path / "compiled.py").read_text() == "entry code"
    assert (tmp_path / "compiled_again.py").read_text() == "new code"


def test_a_recompiled_dump_that_differs_in_comment_lines_only_matches(tmp_path):
    """Inductor's comments name the FX nodes a kernel came from, numbered by Dynamo's counters: a graph compiled
    again differs there alone. Code (and a C++ #include) still counts."""
    report = GraphReport(name="graph_0", inference=True, target="cpu", dump_folder=str(tmp_path))
    entry = "#include <x.h>\nbuf0 = f(a)\n    # Source Nodes: [mul_166]\nbuf1 = g(buf0)\n"
    dump_module.dump_matches_entry(report, entry.replace("mul_166", "mul_160"), entry)
    assert report.extra["dump_matches_entry"] is True and not (tmp_path / "compiled_again.py").exists()
    for changed in (entry.replace("g(buf0)", "h(buf0)"), entry.replace("<x.h>", "<y.h>")):
        dump_module.dump_matches_entry(report, changed, entry)
        assert report.extra["dump_matches_entry"] is False


def test_a_recompiled_dump_whose_values_are_numbered_otherwise_matches(tmp_path):
    """The same graph traced in another process numbers its FX nodes after the nodes traced before it there
    (`mul_22` there, `mul_18` here): the names are renumbered by first appearance before the comparison; a
    different use of the values still counts."""
    report = GraphReport(name="graph_2", inference=True, target="cpu", dump_folder=str(tmp_path))
    entry = ("def superkernel_1(self, x_1, mul_22):\n    cat_21 = cat([mul_22, mul_22], -1)\n"
             "    slice_35 = slice(x_1, 3, 0, 9223372036854775807, 2)\n    return (cat_21, slice_35)\n")
    again = entry.replace("mul_22", "mul_18").replace("slice_35", "slice_32")
    dump_module.dump_matches_entry(report, again, entry)
    assert report.extra["dump_matches_entry"] is True and not (tmp_path / "compiled_again.py").exists()
    for changed in (again.replace("[mul_18, mul_18]", "[mul_18, x_1]"), again.replace(", 2)", ", 3)")):
        dump_module.dump_matches_entry(report, changed, entry)
        assert report.extra["dump_matches_entry"] is False, changed

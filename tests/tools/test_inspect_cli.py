"""`ascend-dsa inspect show|diff|html` as sub-commands with their own --help, the short `inspect DUMP` form,
and one-line errors (exit 2, no traceback) for a dump that is missing, a file, unreadable or damaged.
Dumps here are written by hand, so nothing is compiled."""
import contextlib
import io
import json
import os

import pytest

from npu_graph.tools import cli


def stage(folder, index: int, name: str, nodes: list[str]) -> None:
    records = [{"name": n, "op": "call_function", "target": f"aten.{n}.default", "args": [], "kwargs": {},
                "created_by": name} for n in nodes]
    with open(folder / f"{index:02d}_{name}.json", "w") as f:
        json.dump({"stage": name, "nodes": records, "changed": index > 0, "ms": 1.0, "stats": {}}, f)
    (folder / f"{index:02d}_{name}.txt").write_text(f"class {name}:\n")


@pytest.fixture
def dump(tmp_path):
    graph = tmp_path / "dump" / "000_graph_0_1"
    graph.mkdir(parents=True)
    summary = {"graph": "graph_0", "nodes_before": 3, "nodes_after": 2, "fused_ops": {}, "cache": "bypass",
               "passes": [{"name": "canonicalize", "changed": True}], "timings_ms": {"compile": 5.0}}
    (graph / "summary.json").write_text(json.dumps(summary))
    stage(graph, 0, "captured", ["a", "b", "c"])
    stage(graph, 1, "canonicalize", ["a", "c"])
    return tmp_path / "dump"


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(["inspect", *map(str, argv)])
        except SystemExit as exc:  # argparse: --help and usage errors
            code = exc.code
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("view, expected", [("show", ["--graph", "--pass", "DUMP"]),
                                            ("diff", ["DUMP", "A", "B", "--graph"]),
                                            ("html", ["DUMP", "--output"])])
def test_each_view_has_its_own_help(view, expected):
    code, out, _ = run(view, "--help")
    assert code == 0 and out.startswith(f"usage: ascend-dsa inspect {view}")
    assert all(word in out for word in expected), out


def test_inspect_help_lists_the_views():
    code, out, _ = run("--help")
    assert code == 0 and all(f"    {view}" in out for view in ("show", "diff", "html"))


def test_short_form_is_show(dump):
    assert run(dump, "--json")[:2] == run("show", dump, "--json")[:2]
    code, out, _ = run(dump, "--graph", "0", "--pass", "canonicalize", "--json")
    assert code == 0 and json.loads(out)["stage"] == "canonicalize"


def test_diff_and_html_views(dump, tmp_path):
    code, out, _ = run("diff", dump, "captured", "canonicalize", "--json")
    assert code == 0 and [n["name"] for n in json.loads(out)["removed"]] == ["b"]
    code, out, _ = run("html", dump, "-o", tmp_path / "r.html", "--json")
    assert code == 0 and json.loads(out)["report"] == str(tmp_path / "r.html") and (tmp_path / "r.html").exists()


def test_missing_argument_is_a_usage_error(dump):
    code, out, err = run("diff", dump, "captured")
    assert code == 2 and "the following arguments are required: B" in err and out == ""


def one_line_error(code, out, err) -> str:
    assert code == 2 and out == "" and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ascend-dsa inspect: error: "), err
    return lines[0]


def test_a_file_is_not_a_dump(tmp_path):
    archive = tmp_path / "dump.tgz"
    archive.write_bytes(b"\x1f\x8b not a folder")
    line = one_line_error(*run(archive))
    assert "is a file, not a dump folder" in line and "dump_dir" in line


def test_damaged_summary_names_the_dump_and_what_to_do(dump):
    (dump / "000_graph_0_1" / "summary.json").write_text(json.dumps({"passes": "not a list"}))
    for view in (["show", dump], ["html", dump, "-o", dump / "r.html"]):
        line = one_line_error(*run(*view))
        assert f"the dump at {dump} looks damaged" in line and "dump_dir" in line


def test_undecodable_stage_text_is_an_error_not_a_traceback(dump):
    (dump / "000_graph_0_1" / "01_canonicalize.txt").write_bytes(b"\xff\xfe\x00garbage")
    line = one_line_error(*run(dump, "--pass", "canonicalize"))
    assert "looks damaged (UnicodeDecodeError" in line


def test_unreadable_dump_folder(dump, monkeypatch):
    real = os.listdir

    def listdir(path="."):
        if os.path.abspath(path) == str(dump):
            raise PermissionError(13, "Permission denied", str(dump))
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)
    line = one_line_error(*run(dump))
    assert f"cannot read {dump}: Permission denied; check the path and its permissions" in line

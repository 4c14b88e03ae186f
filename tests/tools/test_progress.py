"""Long work reports progress on stderr (one line per step when stderr is not a terminal), so `--json` output
on stdout stays clean JSON: every benchmark case as it runs, and the demo's steps."""
import contextlib
import io
import json
import types

import pytest

from npu_graph.observe import progress
from npu_graph.tools import bench_kernels, cli


def test_step_writes_start_and_done_lines_to_stderr():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            progress.step("decode @ 16384 [ctx16k]", "bench e2e"):
        pass
    assert out.getvalue() == ""
    start, done = err.getvalue().splitlines()
    assert start == "bench e2e: decode @ 16384 [ctx16k] ..."
    assert done.startswith("bench e2e: decode @ 16384 [ctx16k]: done in ") and done.endswith(" s")


def test_failed_step_reports_no_done_line():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(RuntimeError), progress.step("case", "bench"):
        raise RuntimeError("boom")
    assert err.getvalue().splitlines() == ["bench: case ..."]


def test_bench_reports_each_case_and_keeps_json_clean(monkeypatch):
    suite = types.SimpleNamespace(cases=lambda: [{"name": "rms_norm 4096"}, {"name": "rotary_mul 4096"}])
    monkeypatch.setattr(bench_kernels, "SUITES", (suite,))
    monkeypatch.setattr(bench_kernels, "measure", lambda case, repeat: {"case": case["name"], "ours_ms": 1.0})
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert cli.main(["bench", "kernels", "--json", "--repeat", "1"]) == 0
    assert [row["case"] for row in json.loads(out.getvalue())["rows"]] == ["rms_norm 4096", "rotary_mul 4096"]
    started = [line for line in err.getvalue().splitlines() if line.endswith(" ...")]
    assert started == ["bench kernels: rms_norm 4096 ...", "bench kernels: rotary_mul 4096 ..."]


def test_progress_can_be_silenced(monkeypatch):
    monkeypatch.setenv(progress.ENV_SWITCH, "0")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), progress.step("building native kernel x (avx2)"):
        pass
    assert err.getvalue() == ""

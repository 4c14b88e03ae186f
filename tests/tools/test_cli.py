"""The ascend-dsa command line as a user runs it: demo output, module entry, bench errors."""
import json
import os
import subprocess
import sys

import pytest

from npu_graph.tools import bench_e2e


def run_cli(*args, timeout=600, env=None):
    return subprocess.run([sys.executable, "-m", "npu_graph", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_demo_tiny_json(tmp_path):
    p = run_cli("demo", "--config", "tiny", "--prompt-len", "40", "--steps", "3", "--json", "--no-cache",
                "--dump-dir", str(tmp_path))
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)
    assert result["greedy_tokens_equal"]
    assert result["max_abs_diff_prefill"] < 1e-4 and result["max_abs_diff_decode"] < 1e-4
    assert len(result["graphs"]) >= 2 and all(g["nodes_after"] <= g["nodes_before"] for g in result["graphs"])
    assert result["dump_dir"] == str(tmp_path) and list(tmp_path.glob("*/summary.json"))
    assert result["compiled_prefill_ms"] > 0 and result["eager_prefill_ms"] > 0
    assert result["compiled_first_prefill_ms"] > result["compiled_prefill_ms"], "the first call compiles"
    assert "demo: first decode step (compiles the decode graph) ..." in p.stderr.splitlines()
    with open(result["html_report"]) as f:
        assert "<svg" in f.read()


@pytest.mark.slow   # ~2 min: two demo runs, the second compiling again for its dump (a hit with dump_dir)
def test_demo_table_mentions_dump_graphs_and_cache_hits(tmp_path):
    args = ["demo", "--config", "tiny", "--prompt-len", "24", "--steps", "2"]
    env = {"ASCEND_DSA_CACHE_DIR": str(tmp_path / "cache")}
    first = run_cli(*args, "--dump-dir", str(tmp_path / "a"), env=env)
    assert first.returncode == 0, first.stderr
    assert "graphs compiled by ascend_dsa" in first.stdout and "miss" in first.stdout
    assert str(tmp_path / "a") in first.stdout.replace("\n", "")
    second = run_cli(*args, "--dump-dir", str(tmp_path / "b"), env=env)
    assert second.returncode == 0 and "hit" in second.stdout


def test_unknown_bench_suite_is_a_clear_error():
    p = run_cli("bench", "nope")
    assert p.returncode == 2 and "unknown bench suite 'nope'" in p.stderr and "e2e" in p.stderr


@pytest.mark.slow
def test_e2e_case_measures_every_backend():
    model = bench_e2e.build_model("tiny")
    ids = bench_e2e.torch.randint(0, 256, (1, 32))
    rows = bench_e2e.measure_case("tiny prefill", model, ids, 0, repeat=2)
    assert [r["backend"] for r in rows] == list(bench_e2e.BACKENDS)
    assert all(r["median_ms"] > 0 and r["max_abs_diff_vs_eager"] < 1e-3 for r in rows)



@pytest.mark.slow
def test_bench_cache_warm_start_skips_the_backend_work():
    p = run_cli("bench", "cache", "--quick", "--json", timeout=900)
    assert p.returncode == 0, p.stderr
    (row,) = json.loads(p.stdout)["rows"]
    assert row["cold_cache"] == "miss" and row["warm_cache"] == "hit" and row["same_result"]
    assert row["backend_warm_over_cold"] <= 0.2

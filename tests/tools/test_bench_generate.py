"""bench generate: the suite is registered, its core function measures generate() per backend with the fields the
JSON promises (no recompiles after the first call, tokens as eager's), --busy's spinner always stops, and the
text output is one line per model and backend."""
import io

import pytest

from npu_graph.tools import bench_generate, bench_generate_cases
from npu_graph.tools.bench import SUITES
from npu_graph.tools.cli import _parser

FIELDS = {"case", "backend", "prompt", "new_tokens", "busy", "prefill_ms", "decode_tok_s", "generate_ms",
          "first_generate_s", "graphs", "recompiles", "tokens_equal", "first_diff_token", "prefill_speedup_vs_eager",
          "prefill_speedup_vs_inductor", "decode_speedup_vs_eager", "decode_speedup_vs_inductor", "fallback_graphs",
          "impl", "glue", "glue_wait_s"}
TINY_LLAMA = bench_generate_cases.Case("llama tiny", "llama", prompt_len=8, new_tokens=3)


def test_suite_is_registered_and_cli_takes_busy() -> None:
    assert SUITES["generate"] == "npu_graph.tools.bench_generate"
    args = _parser().parse_args(["bench", "generate", "--quick", "--busy", "--json"])
    assert args.suite == "generate" and args.busy and args.quick


def test_cases_cover_every_tiny_family_and_the_mid_configs() -> None:
    assert [c.family for c in bench_generate_cases.cases(quick=True)] == ["deepseek_v32", "kimi_linear"]
    full = bench_generate_cases.cases(quick=False)
    assert {c.family for c in full if c.prompt_len == 64} == set(bench_generate_cases.EXTRA)
    mid = [c for c in full if c.prompt_len == bench_generate_cases.MID_PROMPT]
    assert {c.family for c in mid} == {"deepseek_v32", "kimi_linear"}
    assert all(c.overrides["hidden_size"] == 512 and c.new_tokens == 16 for c in mid)


def test_busy_core_stops_its_process_also_on_error() -> None:
    with pytest.raises(RuntimeError), bench_generate.busy_core() as proc:
        assert proc.poll() is None
        raise RuntimeError("measurement failed")
    assert proc.poll() is not None
    with bench_generate.busy_core(enabled=False) as nothing:
        assert nothing is None


def test_each_backend_frame_has_its_own_code_identity() -> None:
    frames = [bench_generate.own_frame(abs, tag) for tag in ("a", "b")]
    assert frames[0](-2) == 2 and frames[0].__code__.co_filename != frames[1].__code__.co_filename


def _check_rows(rows: list[dict], backends: tuple[str, ...]) -> None:
    assert [r["backend"] for r in rows] == list(backends)
    for row in rows:
        assert set(row) == FIELDS
        assert row["prefill_ms"] > 0 and row["decode_tok_s"] > 0 and row["first_generate_s"] > 0
        assert row["tokens_equal"] and row["first_diff_token"] is None
        compiled = row["backend"] != "eager"
        assert (row["graphs"] >= 1 and row["recompiles"] == 0) if compiled else row["graphs"] is None
    dsa = rows[backends.index("ascend_dsa")]
    assert isinstance(dsa["impl"], str) and dsa["fallback_graphs"] == 0 and dsa["glue_wait_s"] >= 0
    assert dsa["prefill_speedup_vs_eager"] == pytest.approx(rows[0]["prefill_ms"] / dsa["prefill_ms"])


def test_generate_rows_eager_and_ascend_dsa() -> None:
    rows = bench_generate.measure_generate(TINY_LLAMA, ("eager", "ascend_dsa"), repeat=1, busy=True)
    _check_rows(rows, ("eager", "ascend_dsa"))
    assert all(r["busy"] for r in rows) and rows[1]["prefill_speedup_vs_inductor"] is None
    out = io.StringIO()
    bench_generate.print_text({"rows": rows, "notes": bench_generate._ratio_notes(rows)}, out)
    lines = out.getvalue().splitlines()
    assert len([line for line in lines if line.startswith("llama tiny")]) == 2
    assert any("ascend_dsa prefill" in line for line in lines)


@pytest.mark.slow
def test_generate_rows_with_inductor() -> None:
    rows = bench_generate.measure_generate(TINY_LLAMA, bench_generate.BACKENDS, repeat=1)
    _check_rows(rows, bench_generate.BACKENDS)
    assert rows[2]["decode_speedup_vs_inductor"] == pytest.approx(rows[2]["decode_tok_s"] / rows[1]["decode_tok_s"])


def test_cold_runs_in_fresh_processes_and_reports_their_failure() -> None:
    args = _parser().parse_args(["bench", "generate", "--quick", "--cold"])
    assert args.cold
    from npu_graph.tools import bench_generate_cold
    with pytest.raises(RuntimeError, match="the cold generate\\(\\) of llama tiny with no_such_backend failed"):
        bench_generate_cold.measure_cold(TINY_LLAMA, ("no_such_backend",))


@pytest.mark.slow
def test_cold_and_warm_first_generate_of_ascend_dsa() -> None:
    from npu_graph.tools import bench_generate_cold
    (row,) = bench_generate_cold.measure_cold(TINY_LLAMA, ("ascend_dsa",))
    assert row["cold_first_generate_s"] > 0 and row["warm_first_generate_s"] > 0 and row["glue_ready_s"] >= 0
    assert row["cold_vs_inductor_cold"] is None and row["warm_vs_own_cold"] > 0
    out = io.StringIO()
    bench_generate.print_text({"rows": [], "cold": [row]}, out)
    assert "first generate()" in out.getvalue() and "warm" in out.getvalue()

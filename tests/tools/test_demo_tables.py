"""The demo's tables in an 80-column terminal (and a pipe): every pass and fused op name whole, nothing cut
to "…"; the compiled prefill time next to the eager one; user mistakes are one-line errors."""
import contextlib
import io
import re

import pytest
import torch
from rich.console import Console

from npu_graph.observe.report import GraphReport
from npu_graph.pipeline import PASSES
from npu_graph.tools import cli, demo

PASS_NAMES = [p.NAME for p in PASSES]
FUSED_OPS = sorted({name.split("::")[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
                    if name.startswith("ascend_dsa::")})


def render(table, width: int | None = 80) -> str:
    out = io.StringIO()
    Console(file=out, width=width).print(table)   # a StringIO is not a terminal: as when piped
    return out.getvalue()


def report(name: str) -> GraphReport:
    return GraphReport(name, True, "cpu", 1664, 548, fused_ops=dict.fromkeys(FUSED_OPS, 12),
                       passes=[{"name": n, "changed": True} for n in PASS_NAMES], cache="miss",
                       cache_reason="the cache holds no entry under this graph's key (first compile here)",
                       timings_ms={"compile": 15946.0})


@pytest.mark.parametrize("width", [80, None])
def test_graph_table_shows_every_name_whole(width):
    text = render(demo.graphs_table([report("graph_0"), report("graph_1")]), width)
    lines = text.splitlines()
    assert "…" not in text and max(map(len, lines)) <= 80
    words = {w for line in lines for w in re.split(r"[\s│┃]+", line)}
    assert set(PASS_NAMES) <= words and set(FUSED_OPS) <= words, text
    assert len(FUSED_OPS) > 5 and len(PASS_NAMES) > 10


def test_timing_table_has_compiled_prefill_next_to_eager():
    results = {"eager_prefill_ms": 120.0, "compiled_prefill_ms": 40.0, "eager_decode_ms": 30.0,
               "compiled_decode_ms": 10.0, "eager_first_prefill_ms": 130.0, "compiled_first_prefill_ms": 9000.0}
    text = render(demo.timing_table(results))
    prefill = next(line for line in text.splitlines() if "prefill (median" in line)
    assert re.search(r"120\.0\s*│\s*40\.0\s*│\s*3\.00x", prefill), text
    assert "…" not in text and "9000.0" in text


def run_demo(*argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(["demo", *argv])
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue()


@pytest.mark.parametrize("argv, expected", [
    (["--config", "bogus"], "unknown HybridConfig 'bogus'; use one of"),
    (["--config", "tiny", "--prompt-len", "100000"], "exceeds the 'tiny' model's context"),
    (["--steps", "0"], "'0' is not a whole number of at least 1"),
])
def test_demo_mistakes_are_one_line_errors(argv, expected):
    code, err = run_demo(*argv)
    assert code == 2 and expected in err and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("ascend-dsa demo: error:")]

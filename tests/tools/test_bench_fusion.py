"""`ascend-dsa bench fusion`: the suite is registered, counts spellings per family (static and dynamic both), and
times a fused spelling beside Inductor; the real run (every family, S=2048) is the benchmark's, not a test's."""
import dataclasses
import json

import pytest

from npu_graph.tools import bench_fusion, cli
from npu_graph.tools.fusion_spellings import family


def test_a_family_row_counts_drawn_fused_and_exact():
    row = bench_fusion.family_row(family("rms_norm"), 2, seed=3)
    assert (row["family"], row["drawn"], row["fused"], row["exact"]) == ("rms_norm", 2, 2, 2)
    assert row["misses"] == [] and row["space"] > 100


def test_a_spelling_that_does_not_fuse_is_counted_with_its_reason():
    fam = family("rotary")
    wrong = fam.negatives[0]     # x1·c + x2·s spelled where the family expects a rotation
    other_math = dataclasses.replace(
        fam, build=lambda choice: dataclasses.replace(wrong.build(), fused={"rotary_mul": 1}))
    row = bench_fusion.family_row(other_math, 1, seed=0)
    assert (row["drawn"], row["fused"], row["exact"]) == (1, 0, 1)
    assert "rotation" in row["misses"][0]


@pytest.mark.slow
def test_the_suite_prints_families_and_timings_as_json(monkeypatch, capsys):
    monkeypatch.setattr(bench_fusion, "families", lambda: [family("rms_norm"), family("rotary")])
    monkeypatch.setattr(bench_fusion, "TIMED_LENGTH", 512)
    assert cli.main(["bench", "fusion", "--json", "--spellings", "1", "--repeat", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [f["family"] for f in data["families"]] == ["rms_norm", "rotary"]
    assert all(set(f) == {"family", "drawn", "fused", "exact"} and f["drawn"] == 1 for f in data["families"])
    assert [t["fused_op"] for t in data["timings"]] == ["lightning_indexer", "rotary_mul"]
    assert all(t["ascend_dsa_ms"] > 0 and t["inductor_ms"] > 0 for t in data["timings"])


def test_the_text_output_has_a_line_per_family_and_per_timed_case(capsys):
    row = {"family": "rotary", "drawn": 12, "fused": 11, "exact": 12, "space": 146}
    timing = {"case": "rotary S=2048 (16×64)", "fused_op": "rotary_mul", "ascend_dsa_ms": 2.0, "inductor_ms": 3.0,
              "eager_ms": 6.0, "speedup_vs_inductor": 1.5}
    bench_fusion.print_text({"machine": {"cpu": "a CPU"}, "isa": "avx2", "rows": [row, timing],
                             "timings": [timing], "notes": ["a note"]})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "ascend-dsa bench fusion — a CPU, native kernels at avx2"
    assert lines[2].split() == ["rotary", "12", "11", "12", "146"]
    assert lines[3].startswith("rotary S=2048 (16×64): rotary_mul 2 ms, Inductor 3 ms") and "1.50×" in lines[3]
    assert lines[4] == "- a note" and len(lines) == 5

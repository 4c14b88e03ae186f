"""`ascend-dsa bench fleet` end to end: 4 ranks under torchrun (2 simulated nodes × 2) cold on one shared cache
against one rank alone. Its figures carry the fields the command promises, every rank's output equals the lone
process's, and the fleet traced the model once and compiled each graph once (one rank traced and missed, the
others loaded the trace and hit). Minutes on 2 cores: slow-marked."""
import argparse

import pytest

from npu_graph.tools import bench_fleet


@pytest.mark.slow
def test_the_fleet_traces_and_compiles_once_and_answers_as_one_rank():
    result = bench_fleet.run(argparse.Namespace(cold=False))
    assert result["ranks"] == 4 and result["outputs_equal"] is True
    assert result["single_rank_compile_s"] > 0 and result["fleet_compile_cpu_s"] > 0
    single, *fleet = result["rows"]
    assert single["trace"] == "traced" and set(single["cache"].split(",")) == {"miss"}
    assert len(fleet) == 4 and all(row["first_output_s"] > 0 for row in fleet)
    assert sorted(row["trace"] for row in fleet) == ["loaded", "loaded", "loaded", "traced"], fleet
    decisions = [row["cache"].split(",") for row in fleet]
    assert all(sorted(graph) == ["hit", "hit", "hit", "miss"] for graph in zip(*decisions)), decisions

"""`ascend-dsa bench cp` figures at small sizes: zigzag balance against contiguous, and the KDA split's work
and communication accounting."""
import pytest

from npu_graph.models.hybrid import HybridConfig
from npu_graph.tools import bench_cp


def test_causal_rows_zigzag_balanced_contiguous_not():
    rows = bench_cp.causal_rows(1024, HybridConfig.named("tiny"))
    assert [row["case"] for row in rows] == [f"causal T=1024 cp={cp}" for cp in bench_cp.CP_SIZES]
    for cp, row in zip(bench_cp.CP_SIZES, rows):
        assert row["zigzag_max_over_mean"] <= 1.01 and row["zigzag_meets_1.01"]
        assert row["contiguous_max_over_mean"] == pytest.approx(2 - 1 / cp, rel=1e-2)
        assert row["causal_keys_per_rank"] == 1024 * 1025 / 2 / cp


def test_kda_rows_work_fraction_and_bytes():
    rows = bench_cp.kda_rows(256, heads=2, dim=16, chunk=16, repeat=1)
    for cp, row in zip(bench_cp.CP_SIZES, rows):
        assert row["ideal_fraction"] < row["work_fraction_flops"] < 1
        assert row["work_fraction_measured"] > 0
        assert row["allgather_bytes_sent_per_rank"] == 2 * 16 * 32 * 4
        assert row["allgather_bytes_received_per_rank"] == (cp - 1) * row["allgather_bytes_sent_per_rank"]

"""bench ep's arithmetic parts (no ranks): bytes per row and token, per-rank load under routing skew, and the
load with experts placed by the loads of another batch."""
from npu_graph.tools import bench_ep


def test_int8_dispatch_bytes():
    rows = {row["case"]: row for row in bench_ep.bytes_rows()}
    deepseek = rows["bytes DeepSeek-V3 H=7168 k=8"]
    assert deepseek["dispatch_row_bf16"] == 14336 and deepseek["dispatch_row_int8"] == 7172
    assert deepseek["token_int8_dispatch"] == 8 * (7172 + 14336) < deepseek["token_bf16"] == 8 * 2 * 14336


def test_skewed_routing_loads_one_rank_more():
    rows = bench_ep.load_rows(tokens=512, experts=64, top_k=4)
    assert len(rows) == 2 * len(bench_ep.EP_SIZES)
    for uniform, skewed in zip(rows[:3], rows[3:]):
        assert uniform["rows_mean"] == skewed["rows_mean"] == 512 * 4 / int(uniform["case"].rsplit("=", 1)[1])
        assert 1.0 <= uniform["max_over_mean"] < 1.2
        assert skewed["max_over_mean"] > uniform["max_over_mean"]


def test_placement_from_observed_loads_evens_skewed_routing():
    rows = bench_ep.load_rows(tokens=512, experts=64, top_k=4)
    for skewed in rows[3:]:
        assert skewed["balanced_max_over_mean"] < skewed["max_over_mean"]
    assert rows[3]["balanced_max_over_mean"] < 1.05      # EP=2; at EP=8 one hot expert alone exceeds the mean

"""`ascend-dsa bench context`: the work and floor arithmetic of a long-context step, the JSON it prints and the
plot it draws, at toy sizes (no timing is asserted)."""
import contextlib
import io
import json
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest
import torch

from npu_graph.models.cache import HybridCache
from npu_graph.models.context_layer import ContextLayer, bf16_context_layer, real_size_config, weights_bytes
from npu_graph.tools import bench_context, cli, context_costs, context_kda, context_prefill, context_rig
from npu_graph.tools.context_costs import Rates, Work

REAL = real_size_config(4096)
PARAMS, INDEX_PARAMS = 10_000_000, 1_000_000


@pytest.mark.parametrize("fp8", [False, True])
def test_cache_row_bytes_are_what_the_cache_stores(fp8):
    cache = HybridCache(REAL, 1, kv_dtype=torch.float8_e4m3fn, index_dtype=torch.int8) if fp8 else \
        HybridCache(REAL, 1, kv_dtype=torch.bfloat16)      # the caches of the bf16 and FP8 rows
    assert context_costs.cache_row_bytes(REAL, fp8) == cache.bytes_per_token()


def test_fp8_cache_row_is_728_of_bf16s_1408_bytes():
    assert sum(context_costs.cache_row_bytes(REAL, True).values()) == 512 + 16 + 64 + 4 + 128 + 4
    assert sum(context_costs.cache_row_bytes(REAL, False).values()) == 2 * (512 + 64 + 128)


def test_dsa_decode_reads_every_index_key_but_only_topk_latent_rows():
    context = 131072
    work = context_costs.step_work(REAL, PARAMS, INDEX_PARAMS, context, 1, sparse=True, fp8=False)
    assert work["weights"] == Work(2 * PARAMS, 2 * PARAMS)
    assert work["indexer"].bytes == 256 * (context + 1)
    assert work["indexer"].flops == 2 * 64 * 128 * (context + 1)
    assert work["attention"].bytes == 2048 * (1024 + 128)
    assert work["attention"].flops == 2048 * (2 * 128 * 576 + 2 * 128 * 512)


def test_dense_mla_reads_every_latent_row_and_no_indexer_weights():
    work = context_costs.step_work(REAL, PARAMS, INDEX_PARAMS, 4095, 1, sparse=False, fp8=False)
    assert set(work) == {"weights", "attention"}
    assert work["weights"].bytes == 2 * (PARAMS - INDEX_PARAMS)
    assert work["attention"].bytes == 4096 * (1024 + 128)


def test_verify_step_shares_the_rows_its_queries_read():
    one = context_costs.step_work(REAL, PARAMS, INDEX_PARAMS, 100, 1, sparse=True, fp8=False)
    four = context_costs.step_work(REAL, PARAMS, INDEX_PARAMS, 100, 4, sparse=True, fp8=False)
    assert four["weights"].bytes == one["weights"].bytes and four["weights"].flops == 4 * one["weights"].flops
    assert four["attention"].bytes == 104 * (1024 + 128)     # fewer keys than top-k: all of them, once


def test_floor_is_the_larger_of_the_memory_and_compute_bounds_and_at_most_the_op_sum():
    rates = Rates(bandwidth=10.0, gemm_rate=100.0)
    work = {"weights": Work(100.0, 100.0), "indexer": Work(10.0, 1000.0)}
    whole, op_sum = context_costs.floors(work, rates)
    assert whole == max(110 / 10, 1100 / 100) == 11.0
    assert op_sum == 10.0 + 10.0


def test_layer_forms_share_weights_and_dense_mla_matches_dsa_when_topk_covers_the_context():
    config = real_size_config(64, **{**bench_context.TOY_SIZES, "index_topk": 64})
    torch.manual_seed(0)
    layer = ContextLayer(config).eval()
    caches = [HybridCache(config, 1, kv_dtype=torch.float32) for _ in range(2)]
    for cache in caches:
        cache.fill_synthetic_(40)
    x = torch.randn(1, 1, config.hidden_size)
    with torch.no_grad():
        sparse, dense = layer(x, caches[0], True), layer(x, caches[1], False)
    torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-4)
    assert weights_bytes(layer) == 4 * sum(p.numel() for p in layer.parameters())


def test_quantized_indexers_pick_mostly_what_the_bf16_one_picks():
    config = real_size_config(512, **bench_context.TOY_SIZES)
    torch.manual_seed(0)
    layer = ContextLayer(config).eval().bfloat16()
    caches = context_rig.new_caches(config, 512, 400)
    assert caches[True].layers[0].index_k.dtype == torch.int8
    x = torch.randn(1, 1, config.hidden_size).bfloat16()
    overlaps = context_rig.topk_overlaps(layer, x, caches, 400)
    assert set(overlaps) == {"topk_overlap", "topk_overlap_mxfp8"}
    assert all(0.8 <= v <= 1.0 for v in overlaps.values())


def test_the_bf16_layer_is_made_in_bf16():
    layer = bf16_context_layer(real_size_config(64, **bench_context.TOY_SIZES))
    assert {t.dtype for t in [*layer.parameters(), *layer.buffers()] if t.is_floating_point()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32


def test_prefill_work_is_its_chunks_steps_each_after_the_chunks_before():
    chunks = context_costs.prefill_work(REAL, PARAMS, INDEX_PARAMS, 2500, 1024, sparse=True, fp8=False)
    assert len(chunks) == 3
    assert chunks[2] == context_costs.step_work(REAL, PARAMS, INDEX_PARAMS, 2048, 452, sparse=True, fp8=False)
    assert sum(c["weights"].flops for c in chunks) == 2 * PARAMS * 2500


def test_kda_work_counts_three_multiply_adds_per_state_element_and_the_bf16_tensors_once():
    work = context_costs.kda_work(1000, 32, 128, 128)
    assert work.flops == 6 * 128 * 128 * 1000 * 32
    assert work.bytes == 2 * 1000 * 32 * (4 * 128 + 1) + 2 * 1000 * 32 * 128
    split = context_costs.kda_split_work(1000, 32, 128, 128)
    assert split.flops == work.flops + context_costs.kda_work(1000, 32, 128, 256).flops
    assert work.bytes < split.bytes < 3 * work.bytes


def test_toy_sweep_prints_the_documented_json_and_draws_the_plot(monkeypatch, tmp_path):
    monkeypatch.setattr(context_rig, "ROWS", ("dense_eager", "dsa_eager"))
    monkeypatch.setattr(bench_context, "TOY_CONTEXTS", (64, 128))
    monkeypatch.setattr(context_kda, "kda_points", lambda rates, quick, toy: ([], []))   # own (slow) test below
    path = tmp_path / "context.svg"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(["bench", "context", "--toy", "--json", "--repeat", "1", "--plot", str(path)]) == 0
    result = json.loads(out.getvalue())
    assert {"points", "peak_rss_bytes", "weights_bytes", "cache_bytes_held"} <= set(result)
    assert [(p["phase"], p["row"], p["context"]) for p in result["points"]] == [
        ("decode", "dense_eager", 64), ("decode", "dsa_eager", 64), ("decode", "dense_eager", 128),
        ("decode", "dsa_eager", 128), ("prefill", "dense_eager", 256), ("prefill", "dsa_eager", 256)]
    for p in result["points"]:
        assert {"phase", "row", "context", "ms", "floor_ms", "cache_bytes", "topk_overlap"} <= set(p)
        assert p["ms"] > 0 and p["floor_ms"] > 0 and p["topk_overlap"] is None
        assert p["ratio_to_floor"] == pytest.approx(p["ms"] / p["floor_ms"])
    decode = [p for p in result["points"] if p["phase"] == "decode"]
    assert result["cache_bytes_held"] == decode[-1]["cache_bytes"]
    for p in result["points"][4:]:
        assert p["tokens"] == 256 and p["chunk"] == context_prefill.TOY_CHUNK
        assert p["peak_bytes"] is None or p["peak_bytes"] >= 0
        assert p["floor_ms"] <= p["op_floor_sum_ms"]
    memory = result["memory"]       # the compiled ascend_dsa rows in a process of their own
    assert memory["recompiles_at_context"] == 0
    assert result["peak_rss_bytes"] == memory["peak_rss_bytes"] >= memory["weights_bytes"] + memory["cache_bytes_held"]
    assert result["sweep_peak_rss_bytes"] > result["weights_bytes"]
    text = set(ET.parse(path).getroot().itertext())
    assert {"dense_eager", "dsa_eager", "floor dense"} <= text
    assert any(result["machine"]["cpu"] in line for line in text)


@pytest.mark.slow
def test_kda_rows_split_over_two_processes_equal_one_process():
    rates = Rates(bandwidth=1e10, gemm_rate=1e11)
    points, skipped = context_kda.kda_points(rates, quick=True, toy=True)
    assert skipped == []
    one, split = points
    assert (one["row"], split["row"]) == ("kda", "kda_cp2")
    for p in points:
        assert p["phase"] == "prefill" and p["context"] == context_kda.TOY["contexts"][0]
        assert p["ms"] > 0 and p["floor_ms"] > 0 and p["peak_bytes"] > 0
    assert split["rel_diff"] <= 1e-4 and split["state_rel_diff"] <= 1e-4
    assert split["peak_ratio"] == pytest.approx(split["peak_bytes"] / one["peak_bytes"])
    assert len(split["peak_bytes_per_rank"]) == 2 and set(split["parts_ms"]) == {"transition", "exchange", "outputs"}
    assert [int(n) for n in split["model_ms"]] == list(context_kda.MODEL_RANKS)


def test_rows_and_contexts_filters_read_known_rows_and_token_counts():
    assert bench_context._chosen(None, (4096,), int) == (4096,)
    assert bench_context._chosen("4096,131072", (1,), int) == (4096, 131072)
    assert bench_context._chosen("ascend_dsa", context_rig.ROWS, str) == ("ascend_dsa",)
    for given, kind, words in (("ascend", str, "does not know"), ("4k", int, "token counts"), ("0", int, "positive")):
        with pytest.raises(SystemExit, match=words):
            bench_context._chosen(given, context_rig.ROWS if kind is str else (1,), kind)


def test_an_fp8_prefill_point_carries_the_next_tokens_topk_overlap():
    """The FP8 row's prefill point: the FP8 indexer's top-k over the prompt it cached against the bf16 one's."""
    sweep = bench_context.Sweep(True, ("dsa_eager", "ascend_dsa_fp8"))
    points = context_prefill.prefill_points(sweep, 192, context_prefill.TOY_CHUNK, rounds=1)
    by_row = {p["row"]: p for p in points}
    assert by_row["dsa_eager"]["topk_overlap"] is None
    assert 0.5 <= by_row["ascend_dsa_fp8"]["topk_overlap"] <= 1.0



def test_a_baseline_prefill_projected_past_the_budget_is_not_run_and_says_why():
    sweep = SimpleNamespace(config=REAL, weight_params=PARAMS, index_params=INDEX_PARAMS,
                            rate_figures={"gemm_bfloat16_flops_per_s": 1e9})
    why = context_prefill._beyond_budget(sweep, "dense_eager", 4096, 1024, budget_s=120.0)
    assert why.startswith("not run:") and "1.0 GFLOP/s" in why
    assert context_prefill._beyond_budget(sweep, "ascend_dsa", 4096, 1024, budget_s=120.0) is None
    fast = SimpleNamespace(**{**vars(sweep), "rate_figures": {"gemm_bfloat16_flops_per_s": 1e15}})
    assert context_prefill._beyond_budget(fast, "dsa_inductor", 4096, 1024, budget_s=120.0) is None

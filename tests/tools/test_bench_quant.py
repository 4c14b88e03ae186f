"""bench quant: the suite is registered, its cache rows meet the size targets, the GEMM table holds every form,
and the fused-call recorder sees the ops it compares."""
import dataclasses

import pytest
import torch

from npu_graph.models.hybrid import HybridConfig
from npu_graph.targets.cpu_gemm_profile import measure
from npu_graph.tools import bench_quant
from npu_graph.tools.bench import SUITES
from npu_graph.tools.quant_accuracy import (
    ABLATIONS,
    _recall,
    ablation_rows,
    fp8_kv_attention_cosines,
    record_fused_calls,
    reference_run,
)


def test_suite_is_registered() -> None:
    assert SUITES["quant"] == "npu_graph.tools.bench_quant"


def test_cache_rows_meet_the_size_targets() -> None:
    rows = {r["case"]: r for r in bench_quant.cache_rows()}
    assert rows["cache bytes/token latent"]["ratio"] <= 0.52
    assert rows["cache bytes/token index_k"]["ratio"] <= 0.52
    assert rows["cache bytes/token k_rope"]["ratio"] < 0.55     # codes and one fp32 scale per token
    assert rows["cache bytes/token all"]["ratio"] <= 0.52


def test_gemm_table_has_every_form() -> None:
    (row,) = measure([(1, 32, 16)], repeat=2)
    assert {"fp32_nt_us", "fp32_nn_us", "bf16_nt_us", "bf16_nn_us"} <= set(row)
    assert all(row[k] > 0 for k in ("fp32_nt_us", "fp32_nn_us", "bf16_nt_us", "bf16_nn_us"))


def test_recorder_sees_indexer_calls_and_recall_counts_valid_picks() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, w = torch.randn(1, 3, 2, 32, generator=gen), torch.randn(1, 5, 1, 32, generator=gen), \
        torch.rand(1, 3, 2, generator=gen)
    with record_fused_calls() as calls:
        out = torch.ops.ascend_dsa.lightning_indexer(q, k, w, sparse_count=4)
    assert len(calls["indexer"]) == 1 and torch.equal(calls["indexer"][0], out[0])
    assert _recall(torch.tensor([[0, 1, -1]]), torch.tensor([[1, 2, 3]])) == (1, 2)


def test_fp8_kv_attention_rerun_on_identical_inputs() -> None:
    gen = torch.Generator().manual_seed(1)
    q, qr = torch.randn(1, 2, 4, 128, generator=gen), torch.randn(1, 2, 4, 16, generator=gen)
    kv, kr = torch.randn(1, 40, 1, 128, generator=gen), torch.randn(1, 40, 1, 16, generator=gen)
    idx = torch.randint(0, 39, (1, 2, 1, 8), generator=gen, dtype=torch.int32)
    with record_fused_calls() as calls:
        torch.ops.ascend_dsa.sparse_flash_attention(q, kv, kv, idx, 0.1, query_rope=qr, key_rope=kr)
    (args,) = calls["attention_args"]
    assert args[1] is args[2] and args[1] is not kv and torch.equal(args[1], kv)
    (cosine,) = fp8_kv_attention_cosines(calls["attention_args"])
    assert 0.999 < cosine < 1.0


@pytest.mark.slow     # ~2 min on a 2-core machine: five compiled runs of the tiny model
def test_ablations_split_the_error_and_show_the_rounding_floor() -> None:
    config = dataclasses.replace(HybridConfig.named("tiny"), kv_lora_rank=128)   # an FP8 cache needs 128
    reference = reference_run("tiny", config, 40, 2)
    rows = {r["case"].removeprefix("accuracy ablation: "): r for r in ablation_rows(reference)}
    assert set(rows) == set(ABLATIONS)
    for row in rows.values():
        assert 0.9 < row["logits_cosine"] <= 1.0 + 1e-9 and 0 <= row["greedy_identical_steps"] <= 2
    assert rows["bf16 cache, no quantization"]["logits_cosine"] > rows["kv fp8 only"]["logits_cosine"]

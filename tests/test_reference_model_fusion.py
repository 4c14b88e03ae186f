"""The reference model compiled with every pass: each DSA layer's indexer and sparse attention, each KDA layer's
step, MoE, norms and AttnRes become fused ops, nothing is left as a near miss, and summary.json lists fused ops
and near misses."""
import glob
import json
import os

import pytest
import torch

import npu_graph
from npu_graph.models.hybrid import HybridConfig, HybridLM


def fused_reports(config_name, tmp_path, prompt=24):
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named(config_name)).eval()
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options(
        {"cache": False, "dump_dir": str(tmp_path)}))
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
    eager_cache, compiled_cache = model.new_cache(1), model.new_cache(1)
    with torch.no_grad():
        for _ in range(2):
            ref, out = model(ids, eager_cache), compiled(ids, compiled_cache)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            ids = ref[:, -1:].argmax(-1)
    return model.config, backend.reports


def check(config, reports, tmp_path):
    dsa = config.layer_types.count("dsa")
    moe_layers = config.num_layers - config.first_k_dense_replace
    assert len(reports) == 2
    for report in reports:
        fused = report.fused_ops
        assert fused["lightning_indexer"] == dsa and fused["sparse_flash_attention"] == dsa
        assert fused["moe_gating_top_k"] == moe_layers and fused["fused_moe"] == moe_layers
        assert fused["rms_norm"] > 0 and fused["attn_res"] > 0
        assert fused["chunk_kda"] == config.layer_types.count("kda")     # prefill calls it, a decode step fuses
        assert report.near_misses() == []
    for path in glob.glob(os.path.join(str(tmp_path), "*", "summary.json")):
        with open(path) as f:
            summary = json.load(f)
        assert summary["near_misses"] == [] and summary["fused_ops"]["sparse_flash_attention"] == dsa


def test_tiny_reference_model_is_fully_fused(tmp_path):
    config, reports = fused_reports("tiny", tmp_path)
    check(config, reports, tmp_path)


@pytest.mark.slow
def test_small_reference_model_is_fully_fused(tmp_path):
    config, reports = fused_reports("small", tmp_path, prompt=64)
    check(config, reports, tmp_path)

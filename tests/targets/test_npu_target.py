"""target="npu" without torch_npu: the reference model's NPU program is written to the dump (indexer, sparse
attention, MoE, norms mapped; KDA / AttnRes labelled composite), the summary has an "npu_program" section,
the CPU program runs with eager numbers, one named warning says the NPU program did not run, and nothing
imported torch_npu."""
import importlib.util
import os
import sys
import warnings

import pytest
import torch

import npu_graph
from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.targets import npu
from tests.targets.program_calls import check_source


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="checks the machine without torch_npu")
def test_reference_model_npu_program(tmp_path, monkeypatch):
    monkeypatch.setattr(npu, "_warned", type(npu._warned)())
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named("tiny")).eval()
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options(
        {"cache": False, "dump_dir": str(tmp_path), "target": "npu", "strict": True}))
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref, out = model(ids, model.new_cache(1)), torch.compile(model, backend=backend)(ids, model.new_cache(1))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert [w.category for w in caught].count(npu.NpuProgramNotExecutedWarning) == 1
    section = backend.reports[0].extra["npu_program"]
    assert section["executed"] is False and os.path.isfile(section["path"])
    calls = section["calls_by_op"]
    for op in ("npu_lightning_indexer", "npu_sparse_flash_attention", "npu_moe_gating_top_k", "npu_rms_norm",
               "npu_rotary_mul"):
        assert calls["torch_npu." + op] >= 1
    assert set(section["unmapped_ops"]) == {"attn_res", "chunk_kda", "causal_lengths"}
    with open(section["path"]) as f:
        source = f.read()
    compile(source, section["path"], "exec")
    assert len(check_source(source)) >= section["op_calls"]
    assert "torch_npu" not in sys.modules

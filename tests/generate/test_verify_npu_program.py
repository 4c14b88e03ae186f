"""The verify graph of speculative decoding for the NPU target (compiled with target="npu", not run): the fused
indexer and sparse attention map to the pinned torch_npu ops with k + 1 query tokens per sequence, and the KDA
checkpoints (chunk_kda_states) are a device recurrence, not a composite."""
import pytest
import torch
from spec_helpers import mtp_model

import npu_graph
from npu_graph.generate.rollback import attach_slots
from npu_graph.targets import npu

K = 2


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::npu_graph.targets.npu.NpuProgramNotExecutedWarning")
def test_verify_graph_maps_multi_token_queries_to_torch_npu(tmp_path, monkeypatch):
    built = []
    real_build = npu.build
    monkeypatch.setattr(npu, "build", lambda gm, *a, **kw: built.append(gm) or real_build(gm, *a, **kw))
    model = mtp_model()
    cache = model.new_cache(2)
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0)), cache)
        attach_slots(cache, "checkpoint", K + 1)
        backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options(
            {"cache": False, "dump_dir": str(tmp_path), "target": "npu", "verify": False}))
        torch.compile(model, backend=backend, fullgraph=True)(torch.zeros(2, K + 1, dtype=torch.long), cache,
                                                              return_hidden=True)
    section = backend.reports[-1].extra["npu_program"]
    assert section["calls_by_op"]["torch_npu.npu_lightning_indexer"] >= 2
    assert section["calls_by_op"]["torch_npu.npu_sparse_flash_attention"] >= 2
    assert "chunk_kda_states" in section["decomposed_ops"]
    assert not {"chunk_kda", "chunk_kda_states"} & set(section["unmapped_ops"])
    fused = [n for n in built[-1].graph.nodes if n.op == "call_function" and getattr(n.target, "_opname", "") in
             ("lightning_indexer", "sparse_flash_attention")]
    assert fused and all(n.args[0].meta["val"].shape[1] == K + 1 for n in fused)      # query [B, k + 1, ...]

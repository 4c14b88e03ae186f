"""Tiny random-config transformers models compile with ascend_dsa and match eager (no downloads)."""
import pytest
import torch

import npu_graph

pytest.importorskip("transformers")

@pytest.mark.parametrize("name", ["deepseek_v32", "kimi_linear", "qwen3_moe", "llama"])
def test_tiny_transformers_model_matches_eager(name, recwarn, tiny_transformers):
    model = tiny_transformers(name)
    ids = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    backend = npu_graph.get_backend({"cache": False})
    before = len(backend.reports)
    with torch.no_grad():
        ref = model(ids).logits
        out = torch.compile(model, backend=backend)(ids).logits
    reports = backend.reports[before:]
    assert reports and not [r for r in reports if r.fallback]
    assert not [w for w in recwarn if "runs eagerly" in str(w.message)]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())

"""The reference HybridLM compiled with ascend_dsa equals eager for prefill and several decode steps, and
one compiled decode graph serves every step."""
import torch

import npu_graph
from npu_graph.models.hybrid import HybridConfig, HybridLM


def test_prefill_and_decode_match_eager_without_recompiles():
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named("tiny")).eval()
    backend = npu_graph.get_backend({"cache": False, "verify": False})
    graphs_before = len(backend.reports)
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(3))
    eager_cache, compiled_cache = model.new_cache(2), model.new_cache(2)
    token_e = token_c = ids
    with torch.no_grad():
        for _ in range(5):
            ref, out = model(token_e, eager_cache), compiled(token_c, compiled_cache)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            token_e = ref[:, -1:].argmax(-1)
            token_c = out[:, -1:].argmax(-1)
            assert torch.equal(token_e, token_c)
    assert torch.equal(eager_cache.lengths, compiled_cache.lengths)
    reports = backend.reports[graphs_before:]
    assert len(reports) == 2 and not [r for r in reports if r.fallback]

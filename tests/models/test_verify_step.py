"""A DSA step of a few new tokens (a speculative verify step) gathers each token's selected rows: it equals the
dense form under the selection's mask (DeepSeek's reference), also where a sequence has fewer visible keys than the
indexer picks, and compiled with ascend_dsa it equals eager with one fused sparse attention and no mask as wide as
the cache."""
import pytest
import torch

import npu_graph
from npu_graph.kernels.native import cpu_isa
from npu_graph.models import dsa
from npu_graph.models.cache import HybridCache
from npu_graph.models.context_layer import ContextLayer, real_size_config

SIZES = {"hidden_size": 64, "num_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "index_n_heads": 4, "index_head_dim": 16, "index_rope_head_dim": 8,
         "index_topk": 16, "intermediate_size": 32, "block_size": 8}
LENGTHS = (5, 40)          # ragged: the first sequence sees fewer keys than the indexer picks


def layer_and_caches(copies: int) -> tuple[ContextLayer, list[HybridCache]]:
    torch.manual_seed(0)
    config = real_size_config(64, **SIZES)
    caches = []
    for _ in range(copies):
        cache = HybridCache(config, len(LENGTHS))
        cache.fill_synthetic_(max(LENGTHS), seed=1)
        cache.lengths.copy_(torch.tensor(LENGTHS, dtype=cache.lengths.dtype))
        caches.append(cache)
    return ContextLayer(config).eval(), caches


@pytest.mark.parametrize("tokens", [2, 3, 4])
def test_gathered_tokens_equal_the_dense_form(tokens, monkeypatch):
    layer, (gathered, dense) = layer_and_caches(2)
    x = torch.randn(len(LENGTHS), tokens, SIZES["hidden_size"])
    with torch.no_grad():
        got = layer(x, gathered)
        monkeypatch.setattr(dsa, "GATHER_MAX_TOKENS", 0)
        want = layer(x, dense)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def compiled_steps_equal_eager() -> None:
    layer, (eager, compiled) = layer_and_caches(2)
    backend = npu_graph.get_backend({"cache": False, "verify": False})
    before = len(backend.reports)
    step = torch.compile(lambda x, cache: layer(x, cache), backend=backend)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for tokens in (1, 3, 4, 2):
            x = torch.randn(len(LENGTHS), tokens, SIZES["hidden_size"], generator=generator)
            torch.testing.assert_close(step(x, compiled), layer(x, eager), rtol=1e-4, atol=1e-4)
    assert torch.equal(eager.lengths, compiled.lengths)
    for report in backend.reports[before:]:
        assert not report.fallback
        assert report.fused_ops.get("sparse_flash_attention") == 1, report.fused_ops


def test_compiled_steps_of_a_few_tokens_equal_eager():
    torch._dynamo.reset()
    compiled_steps_equal_eager()


@pytest.mark.slow
@pytest.mark.parametrize("level", cpu_isa.supported())
def test_compiled_steps_of_a_few_tokens_equal_eager_at_each_level(level, monkeypatch):
    monkeypatch.setenv(cpu_isa.ENV_ISA, level)
    torch._dynamo.reset()
    compiled_steps_equal_eager()

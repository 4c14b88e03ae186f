"""Tiny random-config transformers models compile with ascend_dsa and match eager (no downloads)."""
import pytest
import torch

import npu_graph

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              intermediate_size=128, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MLA = dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
           n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
           moe_intermediate_size=32, first_k_dense_replace=1)
EXTRA = {
    "deepseek_v32": dict(MLA, index_n_heads=4, index_head_dim=16, index_topk=8),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                        kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, qk_head_dim=24,
                        head_dim=16, linear_head_dim=16, linear_num_heads=4, num_experts=8,
                        num_experts_per_token=2, moe_intermediate_size=32),
    "llama": dict(),
}


def build_tiny(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(name, **COMMON, **EXTRA[name])
    for key, value in EXTRA[name].items():
        setattr(config, key, value)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["deepseek_v32", "kimi_linear", "qwen3_moe", "llama"])
def test_tiny_transformers_model_matches_eager(name, recwarn):
    model = build_tiny(name)
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

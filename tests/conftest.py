"""Shared test fixtures: a clean Dynamo state per test, a temporary dump folder, and tiny random-config
transformers models (no downloads)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_cache_options(tmp_path):
    return {"cache": False, "dump_dir": str(tmp_path / "dump")}


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


def _build_tiny(name: str, seed: int = 0, attn_implementation: str | None = None) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(name, **COMMON, **EXTRA[name])
    for key, value in EXTRA[name].items():
        setattr(config, key, value)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs).eval()


@pytest.fixture
def tiny_transformers():
    """build(name, seed=0, attn_implementation=None): a tiny random-config transformers causal LM in eval mode."""
    return _build_tiny

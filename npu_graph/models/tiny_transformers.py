"""Tiny random-config transformers causal LMs (no downloads), for tests and benchmarks: the sizes are small, the
structure is the real model's (DeepSeek-V3.2's indexer and MLA, Kimi Linear's KDA and MoE, Qwen3-MoE, Llama)."""
from __future__ import annotations

import torch

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


def build_tiny(name: str, seed: int = 0, attn_implementation: str | None = None,
               **overrides: object) -> torch.nn.Module:
    """The tiny `name` model (a key of EXTRA) in eval mode, fp32, random weights from `seed`; `overrides` change
    config fields (e.g. max_position_embeddings for long prompts)."""
    import transformers

    torch.manual_seed(seed)
    fields = {**COMMON, **EXTRA[name], **overrides}
    config = transformers.AutoConfig.for_model(name, **fields)
    for key, value in fields.items():
        setattr(config, key, value)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs).eval()

"""The models `ascend-dsa bench generate` runs (tools/bench_generate.py, and its --cold processes): the tiny
random-config families (64-token prompt, 32 new tokens) and mid-size DeepSeek-V3.2 and Kimi Linear configs (MID:
1024-token prompt, 16 new tokens), each a `Case` that builds its model and prompt.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from npu_graph.models.tiny_transformers import EXTRA, build_tiny

TINY_PROMPT, TINY_NEW_TOKENS = 64, 32
MID_PROMPT, MID_NEW_TOKENS = 1024, 16
_MID_COMMON = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                   intermediate_size=1024, vocab_size=4096, max_position_embeddings=8192)
# Mid-size configs (build_tiny overrides): big enough that prefill is real work, small enough for a CPU run.
MID: dict[str, dict[str, Any]] = {
    "deepseek_v32": dict(_MID_COMMON, q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
                         v_head_dim=64, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                         index_n_heads=8, index_head_dim=64, index_topk=256),
    "kimi_linear": dict(_MID_COMMON, layer_types=["linear_attention", "full_attention"] * 2,
                        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_experts=16,
                        num_experts_per_token=4, moe_intermediate_size=256, head_dim=64, linear_head_dim=64,
                        linear_num_heads=8, qk_head_dim=96, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                        kv_lora_rank=256),
}


@dataclass(frozen=True)
class Case:
    """One model to generate with: a tiny_transformers family, its config overrides and the sizes."""
    label: str
    family: str
    prompt_len: int
    new_tokens: int
    overrides: dict[str, Any] = field(default_factory=dict)

    def build(self) -> torch.nn.Module:
        return build_tiny(self.family, **self.overrides)

    def prompt(self) -> torch.Tensor:
        vocab = self.overrides.get("vocab_size", 256)
        return torch.randint(3, vocab, (1, self.prompt_len), generator=torch.Generator().manual_seed(1))


def cases(quick: bool) -> list[Case]:
    """Every tiny family and the MID configs; `quick`: the tiny deepseek_v32 and kimi_linear only."""
    tiny = [Case(f"{name} tiny", name, TINY_PROMPT, TINY_NEW_TOKENS) for name in EXTRA]
    if quick:
        return [c for c in tiny if c.family in ("deepseek_v32", "kimi_linear")]
    return tiny + [Case(f"{name} mid", name, MID_PROMPT, MID_NEW_TOKENS, overrides) for name, overrides in MID.items()]

"""HybridConfig: the sizes of a HybridLM (npu_graph.models.hybrid), checked when made, and the stock configs
(`HybridConfig.named("tiny" | "small" | "stdlib" | "stdlib-mtp" | "ctx16k")`). A module of its own so the
layer modules read the config without importing the model that is built from them."""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass


@dataclass
class HybridConfig:
    """Sizes of a HybridLM. `HybridConfig.named("tiny" | "small" | "ctx16k")` gives the stock ones."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: list[str]
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_rope_head_dim: int
    index_topk: int
    kda_num_heads: int
    kda_head_dim: int
    intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    moe_intermediate_size: int
    max_context: int
    kda_conv_kernel: int = 4
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 1
    attn_res_block_size: int = 2
    block_size: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    mtp_layers: int = 0         # 1: a multi-token-prediction head (mtp.py) for speculative decoding

    def __post_init__(self) -> None:
        self.layer_types = list(self.layer_types)
        checks = {
            "layer_types has one entry per layer": len(self.layer_types) == self.num_layers,
            "layer_types are 'dsa' or 'kda'": set(self.layer_types) <= {"dsa", "kda"},
            "max_context is a multiple of block_size": self.max_context % self.block_size == 0,
            "n_routed_experts splits into n_group groups of >= 2": (
                self.n_routed_experts % self.n_group == 0 and self.n_routed_experts // self.n_group >= 2),
            "topk_group <= n_group": self.topk_group <= self.n_group,
            "index_rope_head_dim < index_head_dim": self.index_rope_head_dim < self.index_head_dim,
            "mtp_layers is 0 or 1 (one MTP module, applied again for further drafts)": self.mtp_layers in (0, 1),
        }
        failed = [name for name, ok in checks.items() if not ok]
        if failed:
            raise ValueError(f"HybridConfig: invalid sizes: {'; '.join(failed)}")

    @classmethod
    def named(cls, name: str) -> HybridConfig:
        """A copy of the stock config `name` (one of CONFIGS)."""
        if name not in CONFIGS:
            raise ValueError(f"unknown HybridConfig {name!r}; use one of {sorted(CONFIGS)}")
        return copy.deepcopy(CONFIGS[name])


_SMALL = HybridConfig(
    vocab_size=8192, hidden_size=512, num_layers=4, layer_types=["dsa", "kda", "dsa", "kda"], num_heads=8,
    q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
    index_n_heads=16, index_head_dim=64, index_rope_head_dim=32, index_topk=256,
    kda_num_heads=8, kda_head_dim=64, intermediate_size=1024,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    moe_intermediate_size=256, max_context=4096 + 256,
)

# Trained on the stdlib's bytes by npu_graph.training (a few minutes on 2 cores); kv_lora_rank and index_head_dim
# fit the FP8 cache of quant="dsa" (multiples of 128 and 32).
_STDLIB = HybridConfig(
    vocab_size=256, hidden_size=128, num_layers=4, layer_types=["dsa", "kda", "dsa", "kda"], num_heads=4,
    q_lora_rank=64, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    index_n_heads=8, index_head_dim=32, index_rope_head_dim=16, index_topk=64,
    kda_num_heads=4, kda_head_dim=32, intermediate_size=256,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    moe_intermediate_size=64, max_context=512, block_size=64,
)

CONFIGS: dict[str, HybridConfig] = {
    # 16 index heads (tiny, small): with few heads, ReLU makes exact-zero scores common, and top-k among exact
    # ties is arbitrary (eager and fused picks may then differ).
    "tiny": HybridConfig(
        vocab_size=256, hidden_size=64, num_layers=4, layer_types=["dsa", "kda", "dsa", "kda"], num_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        index_n_heads=16, index_head_dim=32, index_rope_head_dim=16, index_topk=16,
        kda_num_heads=2, kda_head_dim=32, intermediate_size=128,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
        moe_intermediate_size=32, max_context=256, block_size=16, initializer_range=0.1,
    ),
    "small": _SMALL,
    "stdlib": _STDLIB,
    # stdlib with a multi-token-prediction head trained with it (speculative decoding's drafts, `bench spec`)
    "stdlib-mtp": dataclasses.replace(_STDLIB, mtp_layers=1),
    "ctx16k": dataclasses.replace(_SMALL, max_context=16384 + 256, index_topk=2048),
}

"""A small next-generation hybrid decoder in plain PyTorch: the reference model the compiler fuses.

Layers alternate DeepSeek sparse attention (`dsa.py`) and Kimi delta attention (`kda.py`) as token mixers,
followed by a dense SwiGLU MLP (the first `first_k_dense_replace` layers) or DeepSeek MoE (`moe.py`). Residual
connections are block attention residuals (`attn_res.py`). Inference state lives in a `HybridCache`
(`cache.py`); the same `forward(input_ids, cache)` serves prefill (T > 1, from any cached length) and decode
(T = 1), reads positions from the cache's length tensor and keeps every shape static, so it traces with
`torch.compile(fullgraph=True)` and one decode graph serves every step.

Inference runs under `torch.no_grad()` in eval mode. In training mode (npu_graph.training) every input is one
whole sequence from an empty cache, and the lightning indexers and MoE routers keep their auxiliary losses in
`aux_loss` after each forward (`aux_losses(model)` collects them).

With `mtp_layers=1` the model also has a multi-token-prediction head (`mtp.py`, DeepSeek-V3's form) for
speculative decoding: `forward(..., return_hidden=True)` returns the last hidden states it reads and `draft`
runs it on its own cache (`new_mtp_cache`); npu_graph.generate owns the decode loops.
"""
from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from npu_graph.models.attn_res import AttnRes
from npu_graph.models.cache import HybridCache
from npu_graph.models.dsa import DSAAttention
from npu_graph.models.kda import KimiDeltaAttention
from npu_graph.models.moe import DeepSeekMoE, MoEGate, SwiGLU
from npu_graph.models.mtp import MTPModule, mtp_block_config
from npu_graph.models.norm import RMSNorm


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


class DecoderLayer(nn.Module):
    """Token mixer (DSA or KDA) and MLP (dense or MoE), each fed by its own AttnRes over depth."""

    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.kind = config.layer_types[layer_idx]
        mixer = DSAAttention if self.kind == "dsa" else KimiDeltaAttention
        self.mixer = mixer(config, layer_idx)
        dense = layer_idx < config.first_k_dense_replace
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size) if dense else DeepSeekMoE(config)
        self.mixer_res = AttnRes(config.hidden_size, config.rms_norm_eps)
        self.mlp_res = AttnRes(config.hidden_size, config.rms_norm_eps)
        self.mixer_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, blocks: list[torch.Tensor], partial: torch.Tensor | None, positions: torch.Tensor,
                cache: HybridCache) -> torch.Tensor:
        """Returns the current block's partial sum with this layer's two sublayer outputs added."""
        h = self.mixer_res(blocks if partial is None else [*blocks, partial])
        if self.kind == "dsa":
            mixed = self.mixer(self.mixer_norm(h), positions, cache)
        else:
            mixed = self.mixer(self.mixer_norm(h), cache)
        partial = mixed if partial is None else partial + mixed
        h = self.mlp_res([*blocks, partial])
        return partial + self.mlp(self.mlp_norm(h))


class HybridLM(nn.Module):
    """Embedding, decoder layers with block attention residuals, final AttnRes + norm, LM head."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.final_res = AttnRes(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.mtp_layers:
            self.mtp = MTPModule(config, DecoderLayer(mtp_block_config(config), 0))
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding, MoEGate)):
            nn.init.normal_(module.weight, std=std)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> HybridLM:
        """The model saved at `path` by npu_graph.training (config.json + model.safetensors), in eval mode;
        a missing or damaged checkpoint raises CheckpointError naming the file and what to do."""
        from npu_graph.training.checkpoint import load_model

        return load_model(path)

    def new_cache(self, batch_size: int, kv_dtype: torch.dtype = torch.float32) -> HybridCache:
        """An empty cache for `batch_size` sequences of up to `config.max_context` tokens."""
        return HybridCache(self.config, batch_size, kv_dtype=kv_dtype)

    def new_mtp_cache(self, batch_size: int, kv_dtype: torch.dtype = torch.float32) -> HybridCache:
        """An empty cache for the MTP head's block (`draft`)."""
        return HybridCache(mtp_block_config(self.config), batch_size, kv_dtype=kv_dtype)

    def draft(self, hidden: torch.Tensor, next_ids: torch.Tensor, mtp_cache: HybridCache
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP head on last hidden states `hidden` `[B, T, D]` (positions i) and the tokens that follow them
        `next_ids` `[B, T]` (positions i+1): (logits for positions i+2 `[B, T, vocab]`, the head's hidden states,
        which stand in for `hidden` when drafting further). Appends the T positions to `mtp_cache`."""
        if not self.config.mtp_layers:
            raise ValueError("HybridLM.draft: this model has no MTP head; build it with HybridConfig(mtp_layers=1)")
        h = self.mtp(hidden, self.embed(next_ids), mtp_cache)
        return self.lm_head(self.mtp.norm(h)), h

    def forward(self, input_ids: torch.Tensor, cache: HybridCache | None = None, return_hidden: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits `[B, T, vocab]` for `input_ids` `[B, T]` following the cached tokens; appends them to `cache`.
        With `return_hidden`, (logits, the last hidden states `[B, T, D]` that the MTP head reads)."""
        if cache is None:
            cache = self.new_cache(input_ids.shape[0])
        positions = cache.positions(input_ids.shape[1])
        blocks = [self.embed(input_ids)]
        partial = None
        for i, layer in enumerate(self.layers):
            if i > 0 and i % self.config.attn_res_block_size == 0:
                blocks.append(partial)
                partial = None
            partial = layer(blocks, partial, positions, cache)
        cache.advance_(input_ids.shape[1])
        h = self.final_res([*blocks, partial])
        logits = self.lm_head(self.norm(h))
        return (logits, h) if return_hidden else logits


def aux_losses(model: HybridLM) -> dict[str, torch.Tensor]:
    """The auxiliary losses of the last training-mode forward, each averaged over the layers that have it:
    `indexer_kl` (lightning indexers vs dense attention) and `balance` (MoE routers)."""
    found: dict[str, list[torch.Tensor]] = {"indexer_kl": [], "balance": []}
    for module in model.modules():
        loss = getattr(module, "aux_loss", None) if module.training else None
        if loss is not None:
            found["balance" if isinstance(module, MoEGate) else "indexer_kl"].append(loss)
    return {name: torch.stack(losses).mean() for name, losses in found.items() if losses}


@torch.no_grad()
def generate_greedy(model: Callable[[torch.Tensor, HybridCache], torch.Tensor], input_ids: torch.Tensor,
                    steps: int, cache: HybridCache) -> torch.Tensor:
    """Prefill `input_ids` into `cache`, then decode `steps` tokens greedily; returns them, `[B, steps]`.

    `model` is a HybridLM or its torch.compile'd form.
    """
    token = model(input_ids, cache)[:, -1].argmax(dim=-1, keepdim=True)
    tokens = [token]
    for _ in range(steps - 1):
        token = model(token, cache)[:, -1].argmax(dim=-1, keepdim=True)
        tokens.append(token)
    return torch.cat(tokens, dim=1)

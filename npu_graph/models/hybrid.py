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

import os
from collections.abc import Callable

import torch
from torch import nn

from npu_graph.models import checkpoint
from npu_graph.models.attn_res import AttnRes
from npu_graph.models.cache import HybridCache
from npu_graph.models.config import CONFIGS, HybridConfig  # noqa: F401  (re-exported: most users import it from here)
from npu_graph.models.dsa import DSAAttention
from npu_graph.models.kda import KimiDeltaAttention
from npu_graph.models.moe import DeepSeekMoE, MoEGate, SwiGLU
from npu_graph.models.mtp import MTPModule, mtp_block_config
from npu_graph.models.norm import RMSNorm


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
        return checkpoint.load(path, cls)

    @torch.compiler.disable
    def new_cache(self, batch_size: int, kv_dtype: torch.dtype = torch.float32,
                  index_dtype: torch.dtype | None = None) -> HybridCache:
        """An empty cache for `batch_size` sequences of up to `config.max_context` tokens (`index_dtype`: the indexer
        keys' storage, HybridCache's). Never traced: a forward without a cache breaks its graph once here, rather
        than Dynamo restarting on the cache's random block table (a torch.Generator) several times."""
        return HybridCache(self.config, batch_size, kv_dtype=kv_dtype, index_dtype=index_dtype)

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

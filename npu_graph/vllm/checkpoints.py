"""Tiny random-weight checkpoints of the model families vLLM serves, built from configs and saved to a folder.

Each family is a transformers config small enough to compile and serve on a CPU in seconds, with a head size vLLM's
CPU attention supports (64). Nothing is downloaded: the weights are drawn from a fixed seed and saved with
`save_pretrained`, so two builds of a family are the same checkpoint.
"""
from __future__ import annotations

import os
from typing import Any

import torch

FAMILIES = ("llama", "qwen3", "qwen3_moe")

_COMMON = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512,
           "tie_word_embeddings": False}
_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": {"head_dim": 64},
    "qwen3_moe": {"head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
}


def family_config(family: str) -> Any:
    """The transformers config of `family` (one of FAMILIES)."""
    if family not in _CONFIGS:
        raise ValueError(f"family={family!r} is not a tiny checkpoint family; choose one of {FAMILIES}")
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **_COMMON, **_CONFIGS[family])


def build_checkpoint(family: str, folder: str, seed: int = 0) -> str:
    """Save a random-weight `family` checkpoint (float32) in `folder` unless one is there; returns `folder`."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    from transformers import AutoModelForCausalLM

    config = family_config(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def prompts(count: int, vocab_size: int = _COMMON["vocab_size"]) -> list[list[int]]:
    """`count` prompts of token ids of different lengths (5 to 20), the same on every call."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, vocab_size, (5 + (3 * i) % 16,), generator=generator).tolist() for i in range(count)]

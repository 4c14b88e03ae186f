"""Valid calls of every public fused op, for the bad-input probe (tests/kernels/bad_input_probe.py): each `Spec`
builds one call's arguments by name and names the op's readable reference; the probe then spoils one argument
at a time."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from npu_graph.kernels.aten import dense_attention
from npu_graph.kernels.attn_res import reference_attn_res
from npu_graph.kernels.indexer.causal_lengths import reference_causal_lengths
from npu_graph.kernels.indexer.reference import reference_lightning_indexer
from npu_graph.kernels.kda.checks import validate_states
from npu_graph.kernels.kda.chunk_kda import reference_chunk_kda
from npu_graph.kernels.moe.fused_moe import reference_fused_moe
from npu_graph.kernels.moe.gating import reference_moe_gating_top_k
from npu_graph.kernels.quant.block import reference_dequant_block, reference_dynamic_block_quant
from npu_graph.kernels.quant.mx import reference_dequant_mx, reference_dynamic_mx_quant
from npu_graph.kernels.rowwise.rms_norm import reference_add_rms_norm, reference_rms_norm
from npu_graph.kernels.rowwise.rotary_mul import reference_rotary_mul
from npu_graph.kernels.sparse_attention.reference import reference_sparse_flash_attention

OPS = torch.ops.ascend_dsa


@dataclass
class Spec:
    """An op, a function making a valid call's arguments (by name) and the reference; `positional` names the
    arguments passed by position (the rest go by keyword)."""
    name: str
    make: Callable[[torch.Generator], dict[str, Any]]
    op: Callable[..., Any]
    reference: Callable[..., Any]
    positional: tuple[str, ...]

    def call(self, fn: Callable[..., Any], args: dict[str, Any]) -> Any:
        pos = [args[name] for name in self.positional if name in args]
        return fn(*pos, **{k: v for k, v in args.items() if k not in self.positional})


def r(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen)


def _sfa(gen: torch.Generator) -> dict[str, Any]:
    return {"query": r(gen, 1, 2, 4, 32), "key": r(gen, 1, 64, 1, 32), "value": r(gen, 1, 64, 1, 32),
            "sparse_indices": torch.randint(-1, 64, (1, 2, 1, 8), generator=gen, dtype=torch.int32),
            "scale_value": 0.2, "actual_seq_lengths_kv": torch.tensor([60]), "query_rope": r(gen, 1, 2, 4, 16),
            "key_rope": r(gen, 1, 64, 1, 16), "sparse_mode": 3, "sparse_block_size": 1}


def _sfa_paged(gen: torch.Generator) -> dict[str, Any]:
    return {"query": r(gen, 1, 1, 4, 32), "key": r(gen, 4, 16, 1, 32), "value": r(gen, 4, 16, 1, 32),
            "sparse_indices": torch.randint(-1, 64, (1, 1, 1, 8), generator=gen, dtype=torch.int32),
            "scale_value": 0.2, "block_table": torch.tensor([[2, 0, 3, 1]], dtype=torch.int32),
            "actual_seq_lengths_kv": torch.tensor([50]), "layout_kv": "PA_BSND"}


def _indexer(gen: torch.Generator) -> dict[str, Any]:
    return {"query": r(gen, 1, 2, 4, 32), "key": r(gen, 1, 64, 1, 32), "weights": r(gen, 1, 2, 4),
            "actual_seq_lengths_query": torch.tensor([2]), "actual_seq_lengths_key": torch.tensor([60]),
            "sparse_count": 16, "sparse_mode": 3}


def _indexer_paged(gen: torch.Generator) -> dict[str, Any]:
    return {"query": r(gen, 1, 1, 4, 32), "key": r(gen, 4, 16, 1, 32), "weights": r(gen, 1, 1, 4),
            "actual_seq_lengths_key": torch.tensor([64]), "block_table": torch.tensor([[0, 1, 2, 3]]),
            "sparse_count": 16, "layout_key": "PA_BSND"}


def _gating(gen: torch.Generator) -> dict[str, Any]:
    return {"x": r(gen, 4, 16), "k": 4, "bias": r(gen, 16), "k_group": 2, "group_count": 4, "renorm": 1,
            "norm_type": 1, "routed_scaling_factor": 2.5, "eps": 1e-20}


def _experts(gen: torch.Generator) -> dict[str, Any]:
    return {"x": r(gen, 3, 8), "w13": r(gen, 4, 12, 8), "w2": r(gen, 4, 8, 6),
            "topk_weights": torch.rand(3, 2, generator=gen), "topk_ids": torch.tensor([[0, 2], [1, 3], [3, 0]])}


def _kda(gen: torch.Generator) -> dict[str, Any]:
    k = torch.nn.functional.normalize(r(gen, 1, 20, 2, 8), dim=-1)
    return {"q": r(gen, 1, 20, 2, 8), "k": k, "v": r(gen, 1, 20, 2, 4), "g": -torch.rand(1, 20, 2, 8, generator=gen),
            "beta": torch.rand(1, 20, 2, generator=gen), "scale": 0.3, "initial_state": r(gen, 1, 2, 8, 4),
            "output_final_state": True, "chunk_size": 8}


def _kda_states(gen: torch.Generator) -> dict[str, Any]:
    args = _kda(gen)
    del args["output_final_state"]
    return {**args, "num_states": 5}


def _norm(gen: torch.Generator) -> dict[str, Any]:
    return {"x": r(gen, 3, 64), "gamma": r(gen, 64), "epsilon": 1e-6}


def _add_norm(gen: torch.Generator) -> dict[str, Any]:
    return {"x1": r(gen, 3, 64), "x2": r(gen, 3, 64), "gamma": r(gen, 64), "epsilon": 1e-6}


def _rotary(gen: torch.Generator) -> dict[str, Any]:
    return {"input": r(gen, 2, 3, 2, 16), "r1": r(gen, 1, 3, 1, 16), "r2": r(gen, 1, 3, 1, 16),
            "rotary_mode": "half"}


def _lengths(gen: torch.Generator) -> dict[str, Any]:
    return {"mask": torch.ones(2, 3, 10, dtype=torch.bool).tril(7), "additive": False, "windows": True}


def _depth(gen: torch.Generator) -> dict[str, Any]:
    return {"blocks": r(gen, 3, 1, 2, 16), "partial": r(gen, 1, 2, 16), "queries": r(gen, 2, 16),
            "norm_weight": r(gen, 16), "eps": 1e-6}


def _block_quant(gen: torch.Generator) -> dict[str, Any]:
    return {"x": r(gen, 2, 256), "block_size": 128, "scale_fmt": "fp32"}


def _block_dequant(gen: torch.Generator) -> dict[str, Any]:
    return {"y": r(gen, 2, 256).to(torch.float8_e4m3fn), "scale": torch.rand(2, 2, generator=gen), "block_size": 128}


def _mx_quant(gen: torch.Generator) -> dict[str, Any]:
    return {"x": r(gen, 2, 64), "axis": -1, "block_size": 32}


def _mx_dequant(gen: torch.Generator) -> dict[str, Any]:
    y, scale = reference_dynamic_mx_quant(r(gen, 2, 64))
    return {"y": y, "scale": scale, "axis": -1, "block_size": 32}


def _dense(gen: torch.Generator) -> dict[str, Any]:
    return {"query": r(gen, 1, 2, 70, 24), "key": r(gen, 1, 2, 70, 24), "value": r(gen, 1, 2, 70, 24),
            "is_causal": True}


def _dense_reference(query, key, value, is_causal=False, **kwargs):
    """torch's own kernel, which the binder stands in for; where it cannot run (empty lengths), softmax attention
    as torch's math writes it (no key: 0)."""
    dense_attention._checked(query, key, value, is_causal)      # what torch's kernel assumes (it would crash)
    if all(n > 0 for n in (*query.shape, *key.shape)):
        query, key, value = (x.contiguous() for x in (query, key, value))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal)[:1]
    groups = query.shape[1] // max(1, key.shape[1])
    k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    logits = query @ k.mT * query.shape[-1] ** -0.5
    if is_causal:
        logits = logits.masked_fill(torch.ones(logits.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(logits, -1) @ v,)


def _kda_reference(q, k, v, g, beta, chunk_size=64, **kwargs):
    return reference_chunk_kda(q, k, v, g, beta, **kwargs)


def _kda_states_reference(q, k, v, g, beta, scale=None, initial_state=None, *, num_states, chunk_size=64):
    """The recurrence's output and final state, and its state after each of the first steps (the final state of
    the recurrence run over that many tokens)."""
    validate_states(q, k, v, g, beta, initial_state, chunk_size, num_states)
    o, final = reference_chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   output_final_state=True)
    states = [reference_chunk_kda(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], scale=scale,
                                  initial_state=initial_state, output_final_state=True)[1]
              for n in range(1, num_states + 1)]
    return o, final, torch.stack(states, 1) if states else final.new_empty(final.shape[0], 0, *final.shape[1:])


SPECS = [
    Spec("sparse_flash_attention", _sfa, OPS.sparse_flash_attention, reference_sparse_flash_attention,
         ("query", "key", "value", "sparse_indices", "scale_value")),
    Spec("sparse_flash_attention paged", _sfa_paged, OPS.sparse_flash_attention, reference_sparse_flash_attention,
         ("query", "key", "value", "sparse_indices", "scale_value")),
    Spec("lightning_indexer", _indexer, OPS.lightning_indexer, reference_lightning_indexer,
         ("query", "key", "weights")),
    Spec("lightning_indexer paged", _indexer_paged, OPS.lightning_indexer, reference_lightning_indexer,
         ("query", "key", "weights")),
    Spec("moe_gating_top_k", _gating, OPS.moe_gating_top_k, reference_moe_gating_top_k, ("x", "k", "bias")),
    Spec("fused_moe", _experts, OPS.fused_moe, reference_fused_moe, ("x", "w13", "w2", "topk_weights", "topk_ids")),
    Spec("chunk_kda", _kda, OPS.chunk_kda, _kda_reference, ("q", "k", "v", "g", "beta")),
    Spec("chunk_kda_states", _kda_states, OPS.chunk_kda_states, _kda_states_reference, ("q", "k", "v", "g", "beta")),
    Spec("rms_norm", _norm, OPS.rms_norm, reference_rms_norm, ("x", "gamma", "epsilon")),
    Spec("add_rms_norm", _add_norm, OPS.add_rms_norm, reference_add_rms_norm, ("x1", "x2", "gamma", "epsilon")),
    Spec("rotary_mul", _rotary, OPS.rotary_mul, reference_rotary_mul, ("input", "r1", "r2", "rotary_mode")),
    Spec("causal_lengths", _lengths, OPS.causal_lengths, reference_causal_lengths, ("mask", "additive", "windows")),
    Spec("attn_res", _depth, OPS.attn_res, reference_attn_res, ("blocks", "partial", "queries", "norm_weight")),
    Spec("dynamic_block_quant", _block_quant, OPS.dynamic_block_quant, reference_dynamic_block_quant, ("x",)),
    Spec("dequant_block", _block_dequant, OPS.dequant_block, reference_dequant_block, ("y", "scale")),
    Spec("dynamic_mx_quant", _mx_quant, OPS.dynamic_mx_quant, reference_dynamic_mx_quant, ("x",)),
    Spec("dequant_mx", _mx_dequant, OPS.dequant_mx, reference_dequant_mx, ("y", "scale")),
    Spec("flash_attention_for_cpu", _dense, dense_attention.flash_attention_for_cpu, _dense_reference,
         ("query", "key", "value")),
]

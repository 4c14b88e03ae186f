"""Inputs and per-rank programs for the distributed CP tests (importable by name in spawned ranks).

The inputs come from fixed seeds, so every rank and the single-process reference in the test build the
same tensors; each rank takes its own slice.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.parallel import (
    ParallelGroups,
    cp_dsa_prefill,
    cp_lightning_indexer,
    cp_sparse_attention,
    gather_zigzag,
    init_cp_tp,
    kda_split,
    zigzag_split,
)

SEQ = 64            # divisible by 2·cp for cp = 2 and 4
SPARSE_COUNT = 16
KDA_SEQ = 90        # uneven slices: tensor_split over 4 ranks gives 23, 23, 22, 22 tokens
DSA_LAYERS = (0, 2)


def indexer_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query [2,SEQ,8,32], key [2,SEQ,1,32], weights [2,SEQ,8]; q·k > 0, so no ReLU zeros tie scores."""
    g = torch.Generator().manual_seed(1)
    query = torch.rand(2, SEQ, 8, 32, generator=g)
    key = torch.rand(2, SEQ, 1, 32, generator=g)
    return query, key, torch.randn(2, SEQ, 8, generator=g)


def attention_inputs() -> dict[str, torch.Tensor]:
    """MLA absorbed-form query, latent KV and RoPE parts, plus causal top-k indices with -1 pads."""
    g = torch.Generator().manual_seed(2)
    query, key, weights = indexer_inputs()
    indices, _ = torch.ops.ascend_dsa.lightning_indexer(query, key, weights, sparse_count=SPARSE_COUNT)
    return {"query": torch.randn(2, SEQ, 4, 32, generator=g), "key": torch.randn(2, SEQ, 1, 32, generator=g),
            "query_rope": torch.randn(2, SEQ, 4, 16, generator=g),
            "key_rope": torch.randn(2, SEQ, 1, 16, generator=g), "sparse_indices": indices}


def reference_model() -> tuple[HybridLM, torch.Tensor]:
    """The tiny reference model and a prefill input [2,SEQ,hidden] for its DSA layers."""
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named("tiny")).eval()
    return model, torch.randn(2, SEQ, model.config.hidden_size, generator=torch.Generator().manual_seed(3))


def kda_inputs() -> dict[str, torch.Tensor]:
    """q, k, v, g, beta for 2 heads, K=16, V=8 over KDA_SEQ tokens, and an initial state."""
    gen = torch.Generator().manual_seed(4)
    shape = (2, KDA_SEQ, 2, 16)
    return {"q": F.normalize(torch.randn(shape, generator=gen), dim=-1),
            "k": F.normalize(torch.randn(shape, generator=gen), dim=-1),
            "v": torch.randn(2, KDA_SEQ, 2, 8, generator=gen),
            "g": -torch.rand(shape, generator=gen) * 0.3,
            "beta": torch.rand(2, KDA_SEQ, 2, generator=gen),
            "initial_state": torch.randn(2, 2, 16, 8, generator=gen)}


def _split(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    return zigzag_split(x, groups.cp, groups.cp_rank, dim=1)


def _indexer(groups: ParallelGroups) -> tuple[torch.Tensor, torch.Tensor]:
    query, key, weights = (_split(t, groups) for t in indexer_inputs())
    indices, values = cp_lightning_indexer(query, key, weights, groups.cp_group, sparse_count=SPARSE_COUNT,
                                           row_group=groups.tp_group)
    return gather_zigzag(indices, groups.cp_group, 1), gather_zigzag(values, groups.cp_group, 1)


def _attention(groups: ParallelGroups) -> list[torch.Tensor]:
    local = {name: _split(t, groups) for name, t in attention_inputs().items()}
    outs = cp_sparse_attention(local["query"], local["key"], local["sparse_indices"], 0.125, groups.cp_group,
                               query_rope=local["query_rope"], key_rope=local["key_rope"])
    return [gather_zigzag(t, groups.cp_group, 1) for t in outs]


def _dsa(groups: ParallelGroups) -> list[torch.Tensor]:
    model, x = reference_model()
    with torch.no_grad():
        return [gather_zigzag(cp_dsa_prefill(model.layers[i].mixer, _split(x, groups), groups), groups.cp_group, 1)
                for i in DSA_LAYERS]


def _kda(groups: ParallelGroups) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = kda_inputs()
    local = {name: inputs[name].tensor_split(groups.cp, dim=1)[groups.cp_rank] for name in "qkvg"}
    beta = inputs["beta"].tensor_split(groups.cp, dim=1)[groups.cp_rank]
    return kda_split(local["q"], local["k"], local["v"], local["g"], beta, groups.cp_group,
                     initial_state=inputs["initial_state"], chunk_size=16)


def run_checks(layouts: list[tuple[int, int]]) -> dict:
    """On every rank: each CP form for each (cp, tp) layout of this world, plus the groups' error for a
    wrong layout. Indexer, attention and DSA results come back restored to the original order."""
    out: dict = {"rank": dist.get_rank()}
    for cp, tp in layouts:
        groups = init_cp_tp(cp, tp)
        out[(cp, tp)] = {"cp_rank": groups.cp_rank, "tp_rank": groups.tp_rank, "indexer": _indexer(groups),
                         "attention": _attention(groups), "dsa": _dsa(groups), "kda": _kda(groups)}
    try:
        init_cp_tp(3, 1)
    except ValueError as error:
        out["layout_error"] = str(error)
    return out

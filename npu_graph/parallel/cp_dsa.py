"""Prefill of the reference model's DSA attention layer (models/dsa.py DSAAttention) under CP×TP.

The sequence is zigzag-split over the CP group; inside a CP group, TP splits the attention heads: each TP
rank computes q_b and kv_b for its heads only, attends, and applies its columns of o_proj; one all-reduce
over the TP group sums the partial outputs. The low-rank projections, norms and RoPE keys are per token and
small, so every TP rank of a CP rank computes them for its own tokens; the TP ranks share the lightning
indexer's scoring by query rows (cp_indexer.py `row_group`). The indexer
and the attention are the CP forms (cp_indexer.py, cp_attention.py) on the fused ops; the result equals the
layer's single-process prefill for this rank's tokens. The layer's paged cache is neither read nor written.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from npu_graph.models.dsa import DSAAttention, LightningIndexer, apply_rope
from npu_graph.parallel.cp_attention import cp_sparse_attention
from npu_graph.parallel.cp_indexer import cp_lightning_indexer
from npu_graph.parallel.groups import ParallelGroups, group_size_rank
from npu_graph.parallel.zigzag import zigzag_split


def _head_slice(n_heads: int, tp_group: dist.ProcessGroup | None) -> slice:
    size, rank = group_size_rank(tp_group)
    if n_heads % size:
        raise ValueError(f"cp_dsa_prefill: {n_heads} attention heads do not split over tp={size} ranks; "
                         f"choose a tp that divides the head count")
    per_rank = n_heads // size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _indexer_inputs(indexer: LightningIndexer, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The indexer's query [B,S,N,D], key [B,S,1,D] and weights [B,S,N] for these tokens (as the layer does)."""
    def rope_part(t: torch.Tensor) -> torch.Tensor:
        pe, nope = t.split([indexer.rope_dim, indexer.head_dim - indexer.rope_dim], dim=-1)
        return torch.cat((apply_rope(pe, cos, sin, interleaved=False), nope), dim=-1)

    batch, seq, _ = x.shape
    q = rope_part(indexer.wq_b(qr).view(batch, seq, indexer.n_heads, indexer.head_dim))
    k = rope_part(indexer.k_norm(indexer.wk(x)).unsqueeze(2))
    weights = indexer.weights_proj(x) * indexer.n_heads ** -0.5 * indexer.softmax_scale
    return q, k, weights


def cp_dsa_prefill(attn: DSAAttention, x: torch.Tensor, groups: ParallelGroups | None) -> torch.Tensor:
    """The layer's output [B,2L,hidden] for this rank's zigzag slice x [B,2L,hidden] of a prefill from
    position 0 (the whole sequence is 2L·cp tokens); `groups` None runs in one process."""
    cp_group = groups.cp_group if groups is not None else None
    tp_group = groups.tp_group if groups is not None else None
    cp_size, cp_rank = group_size_rank(cp_group)
    batch, seq, _ = x.shape
    positions = zigzag_split(torch.arange(seq * cp_size, device=x.device), cp_size, cp_rank, dim=0).expand(batch, seq)
    cos, sin = attn.rotary(positions)
    heads = _head_slice(attn.n_heads, tp_group)
    qk_dim = attn.nope_dim + attn.rope_dim
    qr = attn.q_norm(attn.q_a(x))
    q = F.linear(qr, attn.q_b.weight.view(attn.n_heads, qk_dim, -1)[heads].flatten(0, 1))
    q_nope, q_rope = q.view(batch, seq, -1, qk_dim).split([attn.nope_dim, attn.rope_dim], dim=-1)
    q_rope = apply_rope(q_rope, cos, sin, interleaved=True)
    latent, k_rope = attn.kv_a(x).split([attn.kv_lora_rank, attn.rope_dim], dim=-1)
    latent = attn.kv_norm(latent).unsqueeze(2)
    k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin, interleaved=True)

    indices, _ = cp_lightning_indexer(*_indexer_inputs(attn.indexer, x, qr, cos, sin), cp_group,
                                      sparse_count=attn.indexer.topk, row_group=tp_group)
    w_kv = attn.kv_b.weight.view(attn.n_heads, attn.nope_dim + attn.v_dim, attn.kv_lora_rank)[heads]
    w_uk, w_uv = w_kv.split([attn.nope_dim, attn.v_dim], dim=1)
    q_latent = torch.einsum("bthd,hdc->bthc", q_nope, w_uk)
    out_latent, _, _ = cp_sparse_attention(q_latent, latent, indices, attn.softmax_scale, cp_group,
                                           query_rope=q_rope, key_rope=k_rope)
    out = torch.einsum("bthc,hvc->bthv", out_latent, w_uv).reshape(batch, seq, -1)
    o_weight = attn.o_proj.weight.view(-1, attn.n_heads, attn.v_dim)[:, heads].flatten(1)
    partial = F.linear(out, o_weight)
    if tp_group is not None:
        dist.all_reduce(partial, group=tp_group)
    return partial

"""`ascend_dsa::causal_lengths` — turns a model's attention mask into the per-batch sequence lengths that
the fused DSA operators take (`actual_seq_lengths_query`, `actual_seq_lengths_key`, sparse_mode=3).

The fused operators express causality as "query t of batch b sees keys s <= S2_b − S1_b + t". A fusion pass
cannot prove from the graph that an arbitrary mask has that shape, so it keeps the mask computation and
calls this op, which checks at run time that the mask really is right-down causal (visible keys of every
query are a prefix, growing by one key per query) and raises otherwise — never silently wrong.
"""
from __future__ import annotations

import torch
from torch import Tensor

from npu_graph.kernels.checks import FusedPreconditionError, require_rank

_ADDITIVE_MASKED = -1e30


def _visible(mask: Tensor, additive: bool) -> Tensor:
    if not additive:
        return mask.bool()
    visible = mask == 0
    if not bool((visible | (mask <= _ADDITIVE_MASKED)).all()):
        raise FusedPreconditionError(
            "causal_lengths: an additive mask must hold 0 (visible) or a very large negative value (masked); "
            "this one holds other values, so it cannot become sequence lengths")
    return visible


def reference_causal_lengths(mask: Tensor, additive: bool = False) -> tuple[Tensor, Tensor]:
    """Readable reference: count visible keys row by row and check the causal staircase."""
    visible = _visible(mask, additive)
    batch, rows = visible.shape[:2]
    lengths_q, lengths_k = [], []
    for b in range(batch):
        counts = [int(visible[b, t].sum()) for t in range(rows)]
        for t in range(rows):
            prefix = bool(visible[b, t, :counts[t]].all())
            if not (prefix and counts[t] == max(counts[-1] - (rows - 1 - t), 0)):
                raise FusedPreconditionError(f"causal_lengths: mask row {t} of batch {b} is not right-down causal")
        lengths_q.append(rows)
        lengths_k.append(counts[-1])
    return torch.tensor(lengths_q, dtype=torch.int32), torch.tensor(lengths_k, dtype=torch.int32)


@torch.library.custom_op("ascend_dsa::causal_lengths", mutates_args=())
def causal_lengths(mask: Tensor, additive: bool = False) -> tuple[Tensor, Tensor]:
    """mask [B, S1, S2] (bool: True = visible, or additive float: 0 = visible) -> (actual_seq_lengths_query,
    actual_seq_lengths_key), int32 [B]. Raises ValueError when the mask is not right-down causal."""
    require_rank("causal_lengths", "mask", mask, 3)
    visible = _visible(mask, additive)
    counts = visible.sum(-1, dtype=torch.int32)
    rows = visible.shape[1]
    keys = torch.arange(visible.shape[2], device=mask.device)
    staircase = counts[:, -1:] - (rows - 1 - torch.arange(rows, device=mask.device, dtype=torch.int32))
    staircase = staircase.clamp_min(0)
    prefix = visible == (keys < counts.unsqueeze(-1))
    if not (bool(prefix.all()) and bool((counts == staircase).all())):
        raise FusedPreconditionError(
            "causal_lengths: the attention mask is not right-down causal (each query must see a prefix of the "
            "keys, one more than the query before it)")
    lengths_q = torch.full((visible.shape[0],), rows, dtype=torch.int32, device=mask.device)
    return lengths_q, counts[:, -1].contiguous()


@causal_lengths.register_fake
def _causal_lengths_fake(mask: Tensor, additive: bool = False) -> tuple[Tensor, Tensor]:
    require_rank("causal_lengths", "mask", mask, 3)
    batch = mask.shape[0]
    return mask.new_empty((batch,), dtype=torch.int32), mask.new_empty((batch,), dtype=torch.int32)

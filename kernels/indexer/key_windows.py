"""Left-padded batches in the fused DSA operators: `key_starts`.

A batch of prompts of different lengths padded on the left (transformers' `generate()` with an attention mask)
has, in batch row b, padding keys 0 .. key_starts[b]-1 that no query sees. `ascend_dsa.causal_lengths(mask,
windows=True)` finds those starts (and checks them) from the model's mask; `lightning_indexer` and
`sparse_flash_attention` take them as `key_starts` (int32 [B], an argument of this project, like the fp8 scales;
torch_npu's ops have no counterpart, so the NPU target's description does not ask for them):

- the indexer scores each padded row against its keys from key_starts[b] on (a view, no copy) and shifts the
  selected positions back, so padding is never selected; where scores tie at the k-th key, the native path ranks
  the row as wide as an eager model's masked score row, the padding first (`leading_masked_keys`), so that
  torch.topk picks among equal scores as it does in the eager model;
- sparse attention skips selected positions before key_starts[b], as it skips -1.

Rows without padding (all starts 0, the usual case) take the operators' ordinary paths unchanged.
"""
import threading
from collections.abc import Callable

import torch
from torch import Tensor

from npu_graph.kernels.checks import FusedPreconditionError, require


class _Lead(threading.local):
    keys = 0        # a class default: a missing thread-local attribute costs an exception inside getattr


_LEAD = _Lead()


def leading_masked_keys() -> int:
    """The masked keys before the keys the running indexer call sees: a left-padded row's padding while
    `indexer_by_row` scores it, else 0."""
    return _LEAD.keys


def has_padding(key_starts: Tensor | None) -> bool:
    return key_starts is not None and bool(key_starts.any())


def check_starts(op: str, key_starts: Tensor | None, batch: int) -> None:
    """Shape and dtype only (safe in the fake)."""
    if key_starts is None:
        return
    require(key_starts.dim() == 1 and key_starts.shape[0] == batch and not key_starts.is_floating_point(),
            f"{op}: key_starts must be an integer tensor [B] = [{batch}], got {key_starts.dtype} "
            f"{list(key_starts.shape)}")


def check_start_values(op: str, key_starts: Tensor, keys: int) -> None:
    """Each row's key start lies within its keys, 0 .. keys (the positions the key layout holds)."""
    low, high = (int(x) for x in key_starts.aminmax()) if key_starts.numel() else (0, 0)
    if low < 0 or high > keys:
        raise FusedPreconditionError(f"{op}: `key_starts` {key_starts.tolist()[:8]} fall outside the {keys} keys "
                                     f"(each start must be in [0, {keys}])")


def _row_lengths(lengths: Tensor | None, default: int, batch: int) -> Tensor:
    return torch.full((batch,), default, dtype=torch.int32) if lengths is None else lengths.to(torch.int32)


def indexer_by_row(indexer: Callable[..., tuple[Tensor, Tensor]], query: Tensor, key: Tensor, weights: Tensor,
                   lengths_q: Tensor | None, lengths_k: Tensor | None, block_table: Tensor | None,
                   query_scale: Tensor | None, key_scale: Tensor | None, key_starts: Tensor,
                   **options: object) -> tuple[Tensor, Tensor]:
    """The lightning indexer of a left-padded batch: row b over its keys from key_starts[b] on, positions shifted
    back. `indexer` is the operator itself (called without key_starts)."""
    if block_table is not None:
        raise FusedPreconditionError("lightning_indexer: key_starts (a left-padded batch) with keys read from a "
                                     "paged cache (block_table) are not supported")
    batch, keys = query.shape[0], key.shape[1]
    lq, lk = _row_lengths(lengths_q, query.shape[1], batch), _row_lengths(lengths_k, keys, batch)
    check_start_values("lightning_indexer", key_starts, keys)
    starts = key_starts.tolist()
    indices, values = [], []
    for b, start in enumerate(starts):
        rows = slice(b, b + 1)
        _LEAD.keys = start
        try:
            idx, val = indexer(query[rows], key[rows, start:], weights[rows], lq[rows],
                               (lk[rows] - start).clamp_min(0), None,
                               None if query_scale is None else query_scale[rows],
                               None if key_scale is None else key_scale[rows, start:], **options)
        finally:
            _LEAD.keys = 0
        indices.append(torch.where(idx >= 0, idx + start, idx))
        values.append(val)
    return torch.cat(indices), torch.cat(values)


def drop_padding(sparse_indices: Tensor, key_starts: Tensor, sparse_block_size: int) -> Tensor:
    """sparse_indices with every selected position before its row's key start set to -1 (skipped)."""
    if sparse_block_size != 1:
        raise FusedPreconditionError("sparse_flash_attention: key_starts (a left-padded batch) need "
                                     f"sparse_block_size 1, got {sparse_block_size}")
    starts = key_starts.to(sparse_indices.dtype).view(-1, *([1] * (sparse_indices.dim() - 1)))
    return torch.where(sparse_indices < starts, torch.full_like(sparse_indices, -1), sparse_indices)

"""Prefill for the decode loops: padded prompts into fresh caches, in chunks when they are long.

`prefill(...)` runs the main model over the prompts `[B, P]` (right-padded; `lengths` per row) and returns a
`Prefilled`: the caches, the first generated token of each row, and what the MTP head's first draft reads.

- Chunks: while every row still has more than `chunk` prompt tokens left, the next `chunk` tokens go through one
  forward; the rest (up to `chunk` tokens and the padding) through a last one. The eager attention of a forward
  is `[B, H, T, capacity]`, so a 4K prompt in one forward would hold gigabytes; chunked, one compiled chunk graph
  serves any prompt length.
- Ragged rows: the last forward is cut back to each row's length (paged caches by length, KDA states by the
  replay rollback, kda_slots.py).
- Drafts (`mtp_cache`): the MTP head reads each whole chunk right after the main model (the hidden states there and
  the prompt tokens that follow them); the last forward's positions are left to the first draft's catch-up, which
  also sees the first generated token.

A `Prefilled` can be decoded from several times (benchmarks, shared prompts): the loops decode from `copy()`.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from npu_graph.generate.rollback import attach_slots, detach_slots, keep_prefix_
from npu_graph.models.cache import HybridCache

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Prefilled:
    """Caches after the prompts (`mtp_cache`: None unless prefilled for drafting), the first generated token `[B]`,
    the prompt lengths `[B]` and padded width, and the last forward's hidden states `[B, T, D]` from position
    `start`, with the token after each `[B, T]` (the first generated token after a row's last prompt token)."""

    cache: HybridCache
    mtp_cache: HybridCache | None
    first: torch.Tensor
    lengths: torch.Tensor
    width: int
    hidden: torch.Tensor
    next_ids: torch.Tensor
    start: int
    seconds: float

    def copy(self) -> Prefilled:
        """An independent copy (caches included) to decode from."""
        return copy.deepcopy(self)


def prefill(forward: Forward, draft: Forward | None, caches: tuple[HybridCache, HybridCache | None],
            ids: torch.Tensor, lengths: torch.Tensor, chunk: int | None, kda_scale: float) -> Prefilled:
    """Prefill `ids` `[B, P]` (rows of `lengths`) into `caches` (main, MTP or None) with `forward(ids, cache,
    return_hidden=True)` and, for the MTP cache, `draft(hidden, next_ids, mtp_cache)` (module docstring)."""
    began = time.perf_counter()
    cache, mtp_cache = caches
    start = _whole_chunks(int(lengths.min()), chunk)
    for begin in range(0, start, chunk) if start else ():
        _, hidden = forward(ids[:, begin:begin + chunk], cache, return_hidden=True)
        if mtp_cache is not None:
            draft(hidden, ids[:, begin + 1:begin + chunk + 1], mtp_cache)
    tail = ids[:, start:]
    ragged = bool((lengths != ids.shape[1]).any())
    if ragged:
        attach_slots(cache, "replay", tail.shape[1])
    logits, hidden = forward(tail, cache, return_hidden=True)
    last = lengths.long() - 1 - start
    if ragged:
        keep_prefix_(cache, torch.full_like(lengths, start), last.to(lengths.dtype) + 1, kda_scale)
        detach_slots(cache)
    first = logits[torch.arange(ids.shape[0]), last].argmax(dim=-1)
    next_ids = torch.cat((tail[:, 1:], tail[:, :1]), dim=1).scatter(1, last.unsqueeze(1), first.unsqueeze(1))
    return Prefilled(cache, mtp_cache, first, lengths, ids.shape[1], hidden, next_ids, start,
                     time.perf_counter() - began)


def _whole_chunks(shortest: int, chunk: int | None) -> int:
    """Tokens prefilled in whole chunks: the most that leaves every row at least one token for the last forward."""
    if not chunk:
        return 0
    return (shortest - 1) // chunk * chunk

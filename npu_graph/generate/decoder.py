"""`Decoder`: greedy decoding of a batch of prompts with a HybridLM, plain or speculative with its MTP head.

A round of speculative decoding, per sequence with L tokens cached and the pending token p (predicted, not yet
fed) — all rows at once, each with its own L and accepted count:

1. draft: the MTP head catches up on the positions the last verify accepted (the main model's hidden states there
   and the tokens that follow them; its cache is reset to the last committed length first) and proposes d_1;
   k - 1 single-token MTP steps propose d_2..d_k.
2. verify: one forward of the main model over [p, d_1..d_k] (k + 1 tokens from position L) gives predictions
   y_0..y_k; n = the longest prefix with d_j = y_(j-1).
3. keep: p, d_1..d_n stay in the caches (rollback.keep_prefix_: lengths L + n + 1, KDA states by slot selection
   or replay); y_0..y_n are emitted (d_j = y_(j-1) for the accepted drafts) and y_n is the new pending token.

Rows that already have `steps` tokens keep nothing more (0 accepted), so no row outgrows the cache. Prompts of
different lengths are prefilled together, padded, and each row is cut back to its length with the replay rollback;
long prompts are prefilled in chunks of `prefill_chunk` tokens (prefill.py). `prefill(prompts)` gives the caches
after the prompts, which `greedy` and `speculative` accept in place of prompts and decode from a copy of.
Compiled (`compiled=True`, backend ascend_dsa, static shapes): the prefill, one verify graph per k, one MTP
catch-up graph per k, one MTP step graph and one decode graph; the cache lengths are tensors, so no graph is
compiled again as the context grows.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from npu_graph.generate.prefill import Prefilled, prefill
from npu_graph.generate.rollback import attach_slots, keep_prefix_
from npu_graph.models.cache import HybridCache
from npu_graph.models.hybrid import HybridLM

Prompts = torch.Tensor | Sequence[torch.Tensor] | Prefilled

# Graphs the compiled forms may hold per code object: prefill, decode, and per k a verify / catch-up graph for
# each rollback mode (Dynamo's default limit, 8, would send the later ones back to eager).
RECOMPILE_LIMIT = 64
# Prompt tokens per prefill forward: an eager forward holds [B, H, T, capacity] attention scores.
PREFILL_CHUNK = 256


@dataclass
class SpecStats:
    """What a speculative run did: rounds, draft tokens proposed and accepted (summed over the active rows), and
    the seconds spent drafting, verifying and rolling back."""

    k: int
    rollback: str
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rollback_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed ones."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per row and round (accepted drafts + the corrected or bonus token)."""
        rows = self.drafted / self.k
        return (self.accepted + rows) / rows if rows else 0.0


@dataclass
class _Round:
    """What the next draft needs from the last verify (or the prefill): the main model's hidden states at the
    new positions `[B, T, D]`, the token after each `[B, T]`, the index of the last accepted one `[B]` and the
    committed length before them `[B]`."""

    hidden: torch.Tensor
    next_ids: torch.Tensor
    last: torch.Tensor
    start: torch.Tensor


def pad_prompts(prompts: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids `[B, P]` right-padded with 0, lengths `[B]` int32) of a `[B, P]` tensor or a list of 1-D prompts."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.shape[1] == 0:
            raise ValueError(f"Decoder: prompts must be [B, P] with P >= 1, got {tuple(prompts.shape)}")
        return prompts, torch.full((prompts.shape[0],), prompts.shape[1], dtype=torch.int32)
    if not prompts or any(p.dim() != 1 or p.numel() == 0 for p in prompts):
        raise ValueError("Decoder: give prompts as a [B, P] tensor or a non-empty list of non-empty 1-D tensors")
    lengths = torch.tensor([p.numel() for p in prompts], dtype=torch.int32)
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, :prompt.numel()] = prompt
    return ids, lengths


class Decoder:
    """Owns a model's caches for each call and decodes greedily (module docstring). `options`: the ascend_dsa
    backend's options when `compiled`. `prefill_s` is the wall time of the last call's prefill (or of copying the
    caches of a `Prefilled` it was given)."""

    def __init__(self, model: HybridLM, *, compiled: bool = False, options: dict[str, Any] | None = None,
                 kv_dtype: torch.dtype = torch.float32, prefill_chunk: int | None = PREFILL_CHUNK) -> None:
        self.model = model.eval()
        self.kv_dtype = kv_dtype
        self.prefill_chunk = prefill_chunk
        self.kda_scale = model.config.kda_head_dim ** -0.5
        self.forward, self.draft = model, model.draft
        self.backend = None
        self.prefill_s = 0.0
        if compiled:
            import npu_graph

            self.backend = npu_graph.get_backend(options or {})
            self.forward = torch.compile(model, backend=self.backend, dynamic=False, fullgraph=True)
            self.draft = torch.compile(model.draft, backend=self.backend, dynamic=False, fullgraph=True)

    @torch.no_grad()
    def prefill(self, prompts: torch.Tensor | Sequence[torch.Tensor], draft: bool = False) -> Prefilled:
        """The prompts prefilled into fresh caches (prefill.py); with `draft`, the MTP head's cache too (what
        `speculative` needs). Decoding from it leaves it as it is."""
        ids, lengths = pad_prompts(prompts)
        self._check_room(ids.shape[1], 1, 0)
        if draft:
            self._require_mtp("Decoder.prefill(draft=True)")
        batch = ids.shape[0]
        caches = (self.model.new_cache(batch, self.kv_dtype),
                  self.model.new_mtp_cache(batch, self.kv_dtype) if draft else None)
        with _compile_room():
            done = prefill(self.forward, self.draft, caches, ids, lengths, self.prefill_chunk, self.kda_scale)
        self.prefill_s = done.seconds
        return done

    @torch.no_grad()
    def greedy(self, prompts: Prompts, steps: int) -> torch.Tensor:
        """`steps` greedy tokens per prompt `[B, steps]`, one forward per token."""
        state = self._start(prompts, steps, 0)
        token, tokens = state.first, [state.first]
        with _compile_room():
            for _ in range(steps - 1):
                token = self.forward(token.unsqueeze(1), state.cache)[:, -1].argmax(dim=-1)
                tokens.append(token)
        return torch.stack(tokens, dim=1)

    @torch.no_grad()
    def speculative(self, prompts: Prompts, steps: int, k: int, rollback: str = "checkpoint"
                    ) -> tuple[torch.Tensor, SpecStats]:
        """`steps` greedy tokens per prompt `[B, steps]` by speculative decoding with `k` draft tokens a round
        (module docstring); `rollback` is "checkpoint" or "replay" (npu_graph.models.kda_slots)."""
        self._require_mtp("Decoder.speculative")
        if k < 1:
            raise ValueError(f"Decoder.speculative: k (draft tokens a round) must be >= 1, got {k}")
        begun = self._start(prompts, steps, k)
        cache, mtp_cache, pending = begun.cache, begun.mtp_cache, begun.first
        batch, stats = pending.shape[0], SpecStats(k, rollback)
        out = torch.zeros(batch, steps + k + 2, dtype=torch.long)
        count = torch.ones(batch, dtype=torch.long)
        out[:, 0] = pending
        last = begun.lengths.long() - 1 - begun.start
        state = _Round(begun.hidden, begun.next_ids, last, torch.full_like(last, begun.start))
        attach_slots(cache, rollback, k + 1)
        with _compile_room():
            while int(count.min()) < steps:
                drafts = self._draft(state, mtp_cache, k, stats)
                pending, state, emitted = self._verify(cache, pending, drafts, count < steps, stats)
                _emit_(out, count, emitted, state.last + 1)
        return out[:, :steps], stats

    def _start(self, prompts: Prompts, steps: int, k: int) -> Prefilled:
        """What decoding starts from: a copy of a given Prefilled, else the prompts prefilled now (with the MTP
        head's cache when drafting, k > 0); checks that `steps` tokens and a window of k + 1 fit."""
        if not isinstance(prompts, Prefilled):
            self._check_room(pad_prompts(prompts)[0].shape[1], steps, k)
            return self.prefill(prompts, draft=k > 0)
        self._check_room(prompts.width, steps, k)
        if k and prompts.mtp_cache is None:
            raise ValueError("Decoder.speculative: these prompts were prefilled without the MTP head's cache; "
                             "use decoder.prefill(prompts, draft=True)")
        began = time.perf_counter()
        state = prompts.copy()
        self.prefill_s = time.perf_counter() - began
        return state

    def _require_mtp(self, where: str) -> None:
        if not self.model.config.mtp_layers:
            raise ValueError(f"{where}: the model has no MTP head to draft with; build it with "
                             f"HybridConfig(mtp_layers=1)")

    def _draft(self, state: _Round, mtp_cache: HybridCache, k: int, stats: SpecStats) -> torch.Tensor:
        """k draft tokens `[B, k]`: the MTP head catches up on the last accepted positions, then steps."""
        began = time.perf_counter()
        mtp_cache.lengths.copy_(state.start)
        logits, hidden = self.draft(state.hidden, state.next_ids, mtp_cache)
        rows, last = torch.arange(logits.shape[0]), state.last.clamp(min=0)
        token, hidden = logits[rows, last].argmax(dim=-1), hidden[rows, last].unsqueeze(1)
        mtp_cache.lengths.copy_(state.start + last + 1)
        drafts = [token]
        for _ in range(k - 1):
            logits, hidden = self.draft(hidden, token.unsqueeze(1), mtp_cache)
            token = logits[:, -1].argmax(dim=-1)
            drafts.append(token)
        stats.draft_s += time.perf_counter() - began
        return torch.stack(drafts, dim=1)

    def _verify(self, cache: HybridCache, pending: torch.Tensor, drafts: torch.Tensor, active: torch.Tensor,
                stats: SpecStats) -> tuple[torch.Tensor, _Round, torch.Tensor]:
        """One forward over [pending, drafts]; keeps the accepted prefix of the active rows (none of the others).
        Returns (the new pending tokens, the next draft's inputs, the predictions `[B, k + 1]`)."""
        began = time.perf_counter()
        k = drafts.shape[1]
        start = cache.lengths.long().clone()
        logits, hidden = self.forward(torch.cat((pending.unsqueeze(1), drafts), dim=1), cache, return_hidden=True)
        predicted = logits.argmax(dim=-1)
        matched = (drafts == predicted[:, :k]).long().cumprod(dim=1).sum(dim=1)
        last = torch.where(active, matched, -1)
        verified = time.perf_counter()
        keep_prefix_(cache, start, last + 1, self.kda_scale)
        stats.rollback_s += time.perf_counter() - verified
        stats.verify_s += verified - began
        stats.rounds += 1
        stats.drafted += k * int(active.sum())
        stats.accepted += int(matched[active].sum())
        new_pending = torch.where(active, predicted.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1), pending)
        next_ids = torch.cat((drafts, drafts[:, :1]), dim=1)
        next_ids = next_ids.scatter(1, last.clamp(min=0).unsqueeze(1), new_pending.unsqueeze(1))
        return new_pending, _Round(hidden, next_ids, last, start), predicted

    def _check_room(self, width: int, steps: int, k: int) -> None:
        capacity = self.model.config.max_context
        if steps < 1 or width + steps + k + 1 > capacity:
            raise ValueError(f"Decoder: a prompt of {width} tokens, {steps} new tokens and a window of {k + 1} need "
                             f"{width + steps + k + 1} cache positions; the model's max_context is {capacity} (steps "
                             f"must be >= 1)")


def _emit_(out: torch.Tensor, count: torch.Tensor, predicted: torch.Tensor, kept: torch.Tensor) -> None:
    """Append the first `kept[b]` predictions of each row to `out` at `count[b]` (others go to the last column)."""
    offsets = torch.arange(predicted.shape[1])
    where = torch.where(offsets < kept.unsqueeze(1), count.unsqueeze(1) + offsets, out.shape[1] - 1)
    out.scatter_(1, where.clamp(max=out.shape[1] - 1), predicted)
    count.add_(kept)


@contextlib.contextmanager
def _compile_room() -> Iterator[None]:
    """Dynamo's per-function graph limit raised to RECOMPILE_LIMIT while decoding."""
    with torch._dynamo.config.patch(recompile_limit=max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)):
        yield

"""Cache surgery for speculative decoding: attach per-position KDA slots before a multi-token forward, then keep
only an accepted prefix of it per sequence (paged DSA caches by length, KDA states by slot or replay)."""
from __future__ import annotations

import torch

from npu_graph.models.cache import HybridCache, KDALayerCache
from npu_graph.models.kda_slots import KDASlots


def attach_slots(cache: HybridCache, mode: str, width: int) -> None:
    """Give every KDA layer of `cache` slots for a forward of up to `width` tokens (`mode`: kda_slots.MODES)."""
    for layer in cache.layers:
        if isinstance(layer, KDALayerCache):
            layer.slots = KDASlots.new(layer, mode, width)


def detach_slots(cache: HybridCache) -> None:
    """Single-token forwards again need no slots."""
    for layer in cache.layers:
        if isinstance(layer, KDALayerCache):
            layer.slots = None


def keep_prefix_(cache: HybridCache, start: torch.Tensor, accepted: torch.Tensor, kda_scale: float) -> None:
    """After a multi-token forward from lengths `start` `[B]`, keep its first `accepted[b]` tokens (>= 0):
    lengths become start + accepted (later rows of the paged caches are stale and masked), and every KDA layer's
    recurrent and convolution states are those after the accepted tokens."""
    cache.lengths.copy_(start + accepted)
    for layer in cache.layers:
        if isinstance(layer, KDALayerCache):
            if layer.slots is None:
                raise ValueError("keep_prefix_: a KDA layer has no slots; call attach_slots before the forward")
            layer.slots.rollback_(layer, accepted, kda_scale)

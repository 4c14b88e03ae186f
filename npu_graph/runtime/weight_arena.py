"""The weights a compiled graph made for itself, moved into memory backed by huge pages (Linux).

A decode step reads every weight once, and a model's weights are larger than the caches, so each step streams
them from memory. With 4 KiB pages that stream also walks the page tables: a 1 MiB weight spans 256 pages,
whose translations were evicted by the rest of the step, and hardware prefetchers stop at every page
boundary. Weights in 2 MiB pages need one translation per 2 MiB instead (measured on the 2-core EPYC VM,
decode-sized products over 64 MiB of weights, two threads: a [512, 512] fp32 weight 64 -> 46 us, a
[512, 256] one 35 -> 29 us).

The runtime moves only tensors the graph's prologue materialised (pre-transposed and stacked weights,
npu_graph.runtime.hoist): they belong to the compiled graph, so moving them changes no user tensor and no
memory use. Views and anything sharing storage with an input stay where they are. Where transparent huge
pages are off ("never"), or on other systems, the arena is plain memory: the same values, nothing lost.
"""
from __future__ import annotations

from typing import Any

import torch

from npu_graph.kernels import huge_pages

HUGE_PAGE = huge_pages.HUGE_PAGE
MIN_BYTES = 64 << 10            # smaller tensors are left alone: a few pages, not worth the copy
_ALIGN = 64


def _movable(value: Any, input_storages: set[int]) -> bool:
    return (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.layout == torch.strided
            and not value.requires_grad and value._base is None and value.is_contiguous()
            and value.nbytes >= MIN_BYTES and value.untyped_storage().data_ptr() not in input_storages
            and value.storage_offset() == 0 and value.untyped_storage().nbytes() == value.nbytes)


def pack(values: tuple[Any, ...], inputs: list[Any]) -> tuple[tuple[Any, ...], int]:
    """values with every movable tensor (module docstring) replaced by an equal copy in one huge-page arena;
    and the bytes moved."""
    input_storages = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
    movable = [i for i, v in enumerate(values) if _movable(v, input_storages)]
    if not movable:
        return values, 0
    offsets, total = {}, 0
    for i in movable:
        offsets[i] = total
        total += -(-values[i].nbytes // _ALIGN) * _ALIGN
    arena = huge_pages.buffer(total)
    out = list(values)
    for i in movable:
        value = values[i]
        moved = arena[offsets[i]:offsets[i] + value.nbytes].view(value.dtype).view(value.shape)
        moved.copy_(value)
        out[i] = moved
    return tuple(out), total

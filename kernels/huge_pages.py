"""Tensors in memory backed by 2 MiB pages (Linux transparent huge pages), for operands a decode step streams.

A decode step reads every weight once and gathers cache rows at random: data larger than the caches, whose
4 KiB-page translations the rest of the step has evicted, so each page costs a page-table walk from memory on
top of the data (and hardware prefetchers stop at every page boundary). In 2 MiB pages a 1 MiB weight needs one
translation instead of 256. Where transparent huge pages are off ("never") or the system has none, the memory
is ordinary pages: the same tensors, nothing lost.
"""
from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20


def buffer(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed uint8 starting on a 2 MiB boundary, in a private anonymous mapping advised to use huge
    pages (shared anonymous memory would be shmem, which has a setting of its own); plain zeros on a system
    without private mappings."""
    if not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)        # keeps the mapping alive
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype), in huge pages when it spans at least one (module docstring)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    return buffer(nbytes).view(dtype).view(shape)

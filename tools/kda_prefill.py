"""What one process runs for `bench context`'s KDA rows: the KDA core of a Kimi Linear layer prefilling a prompt,
in one process (`one_process`) or as one rank of the sequence split (`split_rank`, npu_graph.parallel.kda_split's
two-pass `kda_split_blocks` over torch.distributed).

The prompt is a sequence of time blocks of `block` tokens; block i's q, k, v, g and beta (bf16, as a layer's
projections give them: q and k L2-normalised per head, g a small negative log decay, beta in (0, 1)) come from a
generator seeded by (seed, i), so every process makes exactly the blocks it holds and no other. One `chunk_kda`
call per block carries the state to the next (chunked prefill); a block's outputs stay held in bf16.

Memory: `peak_bytes` is the process's peak resident memory (VmHWM, tools/process_memory.py) above its resident
memory before the first block was made: the prompt's inputs and outputs and the calls' temporaries.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from npu_graph.parallel.kda_split import Block, kda_split_blocks
from npu_graph.tools import process_memory

KERNEL_CHUNK = 64       # chunk_kda's chunk_size (speed only; the native recurrence ignores it)


def make_block(seed: int, index: int, block: int, heads: int, dim: int) -> Block:
    """Block `index` of the prompt: (q, k, v, g, beta) `[1, block, heads, dim]` (beta `[1, block, heads]`), bf16."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    shape = (1, block, heads, dim)
    q, k = (F.normalize(torch.randn(shape, generator=generator), dim=-1).bfloat16() for _ in range(2))
    v = torch.randn(shape, generator=generator).bfloat16()
    g = (torch.rand(shape, generator=generator) * -0.1).bfloat16()
    beta = torch.rand(shape[:3], generator=generator).bfloat16()
    return q, k, v, g, beta


def _blocks(seed: int, indices: range, block: int, heads: int, dim: int) -> list[Block]:
    return [make_block(seed, i, block, heads, dim) for i in indices]


def _warm_up(first: Block) -> None:
    """Loads the native library and settles the dispatch decisions of both block shapes the runs use, before
    the memory baseline is taken."""
    q, k, v, g, beta = first
    torch.ops.ascend_dsa.chunk_kda(q, k, v, g, beta, chunk_size=KERNEL_CHUNK)
    values = torch.cat((v, torch.zeros_like(k)), dim=-1)
    torch.ops.ascend_dsa.chunk_kda(q, k, values, g, beta, chunk_size=KERNEL_CHUNK)


def one_process(seq: int, heads: int, dim: int, block: int, seed: int, reference: str) -> dict[str, Any]:
    """Prefill of `seq` tokens in this process; writes its outputs (bf16, raw) to `reference` for the split's
    comparison. Returns seconds, memory and the final state."""
    _warm_up(make_block(seed, 0, block, heads, dim))
    base = process_memory.resident_bytes()
    process_memory.reset_peak()
    blocks = _blocks(seed, range(seq // block), block, heads, dim)
    outputs, state = [], None
    start = time.perf_counter()
    for q, k, v, g, beta in blocks:
        o, state = torch.ops.ascend_dsa.chunk_kda(q, k, v, g, beta, None, state, output_final_state=True,
                                                  chunk_size=KERNEL_CHUNK)
        outputs.append(o)
    seconds = time.perf_counter() - start
    peak = process_memory.peak_bytes()
    with Path(reference).open("wb") as file:
        for o in outputs:
            o.view(torch.int16).numpy().tofile(file)
    return {"seconds": seconds, "peak_bytes": peak - base, "peak_rss_bytes": peak, "final_state": state,
            "threads": torch.get_num_threads()}


def _reference_block(reference: str, index: int, like: torch.Tensor) -> torch.Tensor:
    count = like.numel()
    raw = np.fromfile(reference, dtype=np.int16, count=count, offset=index * count * 2)
    return torch.from_numpy(raw).view(torch.bfloat16).view(like.shape)


def split_rank(seq: int, heads: int, dim: int, block: int, seed: int, reference: str,
               threads: int) -> dict[str, Any]:
    """This rank's contiguous share of the prompt's blocks, prefilled with `kda_split_blocks` over the world
    group on `threads` threads; compared block by block with the one-process outputs in `reference`."""
    torch.set_num_threads(threads)
    world, rank = dist.get_world_size(), dist.get_rank()
    count = seq // block
    mine = range(rank * count // world, (rank + 1) * count // world)
    _warm_up(make_block(seed, mine[0], block, heads, dim))
    base = process_memory.resident_bytes()
    process_memory.reset_peak()
    blocks = _blocks(seed, mine, block, heads, dim)
    outputs: dict[int, torch.Tensor] = {}
    clock: dict[str, float] = {}
    dist.barrier()
    start = time.perf_counter()
    final = kda_split_blocks(blocks, dist.group.WORLD, outputs.__setitem__, chunk_size=KERNEL_CHUNK, clock=clock)
    seconds = time.perf_counter() - start
    peak = process_memory.peak_bytes()
    diff = norm = 0.0
    for i, o in outputs.items():
        expected = _reference_block(reference, mine[i], o).float()
        diff += float((o.float() - expected).square().sum())
        norm += float(expected.square().sum())
    return {"seconds": seconds, "peak_bytes": peak - base, "peak_rss_bytes": peak, "final_state": final,
            "diff_sq": diff, "norm_sq": norm, "clock": clock, "tokens": len(mine) * block, "threads": threads}

"""`bench context`'s prefill points: every row of tools/context_rig.py prefilling an empty cache with a prompt of
4K..16K tokens (`--quick`: 4K) in chunks of CHUNK tokens, as serving engines do (vLLM and SGLang cap the tokens
of one step; here the chunk also bounds the eager rows' score tensors, [128 heads, chunk, context]).

A row's prefill is every chunk in order, each appending its tokens to the cache (the layer reads what the chunks
before it wrote). Rounds alternate the rows' order; `ms` is the median over rounds. `peak_bytes`: the process's
peak resident memory during the row's prefill above its resident memory before it (tools/process_memory.py:
VmHWM, reset before each prefill; None where the kernel refuses the reset). `floor_ms` is the sum of the chunks'
floors (tools/context_costs.py: `prefill_work`). An FP8 row's point carries its `topk_overlap`: the share of the bf16
indexer's top-k that the FP8 row's quantized indexer picks for the next token over the prompt the two prefills cached
(and `topk_overlap_mxfp8`, that of MXFP8 keys: tools/context_rig.topk_overlaps).
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from npu_graph.runtime import glue_upgrade
from npu_graph.tools import context_costs, context_rig, process_memory

CHUNK = 1024
CONTEXTS = {False: (4096, 8192, 16384), True: (4096,)}
TOY_CHUNK = 64
TOY_CONTEXTS = (256,)


def _prefill(step: context_rig.Step, cache: Any, chunks: list[torch.Tensor]) -> None:
    cache.lengths.zero_()
    for x in chunks:
        step(x, cache)


def _measured(run: Any) -> tuple[float, int | None]:
    """(seconds, peak bytes above the resident memory before the call) of `run()`."""
    reset = process_memory.reset_peak()
    before = process_memory.resident_bytes()
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    return seconds, process_memory.peak_bytes() - before if reset else None


def _beyond_budget(sweep: Any, row: str, tokens: int, chunk: int, budget_s: float) -> str | None:
    """Why a baseline row's (eager, Inductor) prefill is not run, or None: its flops at torch's bf16 product rate
    measured in this run (where the CPU has no native bf16 products, under a GFLOP/s) would take past `budget_s`.
    ascend_dsa's rows always run."""
    rate = sweep.rate_figures.get("gemm_bfloat16_flops_per_s")
    if row.startswith("ascend_dsa") or not rate:
        return None
    works = context_costs.prefill_work(sweep.config, sweep.weight_params, sweep.index_params, tokens, chunk,
                                       context_rig.is_sparse(row), row in context_rig.FP8_ROWS)
    projected = sum(w.flops for work in works for w in work.values()) / rate
    if projected <= budget_s:
        return None
    return (f"not run: its {tokens}-token prefill would take about {projected / 60:.0f} min at torch's bf16 product "
            f"rate measured here ({rate / 1e9:.1f} GFLOP/s), past the {budget_s:.0f} s this sweep gives a row")


@torch.no_grad()
def prefill_points(sweep: Any, tokens: int, chunk: int, rounds: int, budget_s: float = float("inf")
                   ) -> list[dict[str, Any]]:
    """Every row's chunked prefill of `tokens` tokens, rounds alternating the rows' order; a baseline row whose
    prefill would take past `budget_s` (`_beyond_budget`) gets a point without `ms`, saying why."""
    config = sweep.config
    caches = context_rig.new_caches(config, tokens, 0)
    generator = torch.Generator().manual_seed(tokens)
    chunks = [torch.randn(1, min(chunk, tokens - s), config.hidden_size, generator=generator).bfloat16()
              for s in range(0, tokens, chunk)]
    skipped = {row: why for row in sweep.steps if (why := _beyond_budget(sweep, row, tokens, chunk, budget_s))}
    steps = {row: step for row, step in sweep.steps.items() if row not in skipped}
    runs = {row: (lambda step=step, cache=caches[row in context_rig.FP8_ROWS]: _prefill(step, cache, chunks))
            for row, step in steps.items()}
    for row, step in steps.items():          # compiles the chunk's shape (one chunk, untimed)
        _prefill(step, caches[row in context_rig.FP8_ROWS], chunks[:1])
    glue_upgrade.wait_all()
    samples: dict[str, list[tuple[float, int | None]]] = {row: [] for row in runs}
    names = list(runs)
    for round_ in range(rounds):
        for row in names if round_ % 2 == 0 else names[::-1]:
            samples[row].append(_measured(runs[row]))
    points = [_point(sweep, row, tokens, chunk, got, caches) for row, got in samples.items()]
    for row, why in skipped.items():
        points.append({**_point(sweep, row, tokens, chunk, [(float("nan"), None)], caches),
                       "ms": None, "ratio_to_floor": None, "skipped": why})
    bf16_indexed = any(context_rig.is_sparse(row) and row not in context_rig.FP8_ROWS for row in samples)
    bf16_indexed = bf16_indexed or "ascend_dsa" in samples
    if bf16_indexed and any(row in context_rig.FP8_ROWS for row in samples):      # both caches hold indexer keys
        after = torch.randn(1, 1, config.hidden_size, generator=generator).bfloat16()
        overlaps = context_rig.topk_overlaps(sweep.layer, after, caches, tokens)
        for p in points:
            if p["row"] in context_rig.FP8_ROWS:
                p.update(overlaps)
    return points


def _point(sweep: Any, row: str, tokens: int, chunk: int, got: list[tuple[float, int | None]],
           caches: dict[bool, Any]) -> dict[str, Any]:
    fp8 = row in context_rig.FP8_ROWS
    works = context_costs.prefill_work(sweep.config, sweep.weight_params, sweep.index_params, tokens, chunk,
                                       context_rig.is_sparse(row), fp8)
    floors = [context_costs.floors(work, sweep.rates) for work in works]
    floor_s, op_sum_s = sum(f for f, _ in floors), sum(s for _, s in floors)
    seconds = statistics.median(s for s, _ in got)
    peaks = [p for _, p in got if p is not None]
    return {"phase": "prefill", "row": row, "context": tokens, "tokens": tokens, "chunk": chunk,
            "ms": 1e3 * seconds, "floor_ms": 1e3 * floor_s, "op_floor_sum_ms": 1e3 * op_sum_s,
            "ratio_to_floor": seconds / floor_s, "cache_bytes": context_rig.held_bytes(caches[fp8]),
            "cache_bytes_read": sum(context_costs.cache_bytes_read(w) for w in works),
            "peak_bytes": max(peaks) if peaks else None, "topk_overlap": None}

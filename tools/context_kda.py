"""`bench context`'s KDA rows: the KDA core of a Kimi Linear layer at real size (32 heads of 128, its gates; the
projections are GEMMs, measured by the layer rows) prefilling a prompt in one process (`kda`) and split over
ranks with npu_graph.parallel.kda_split (`kda_cp2`), each a real process of its own (tools/kda_prefill.py runs
inside them, started by npu_graph.parallel.launch: gloo on CPU).

Each point: time to first token of the core (`ms`: the prefill's calls; for the split, the slowest rank from a
barrier to its last output), `peak_bytes` per process (tools/kda_prefill.py), the roofline floor (`floor_ms`,
tools/context_costs.py: `kda_work`) and, for the split, `rel_diff` of its outputs against the one process's
(‖split − one‖ / ‖one‖ over every output, bf16), `state_rel_diff` of the final states, `peak_ratio` (a rank's
peak over the one process's) and `model_ms`: time to first token with N ranks, each on the split's threads per
rank, from the parts the split measured (tokens per rank × the two passes' per-token costs + the exchange,
whose fold grows with N).
"""
from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from npu_graph.parallel import launch
from npu_graph.tools import context_costs, kda_prefill

HEADS, DIM = 32, 128            # Kimi Linear's KDA: 32 heads, K = V = 128
BLOCK = 2048                    # tokens per chunk_kda call (chunked prefill), and per generated block
CONTEXTS = {False: (16384, 32768, 131072, 1 << 20), True: (131072,)}
TOY = {"heads": 2, "dim": 16, "block": 128, "contexts": (1024,)}
MODEL_RANKS = (2, 4, 8, 16)
LAUNCH_TIMEOUT_S = 900.0
SEED = 7


def needed_bytes(seq: int, heads: int, dim: int) -> int:
    """Memory one process holds for a prompt: bf16 q, k, v, g and outputs (beta is small)."""
    return 10 * seq * heads * dim


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def kda_points(rates: context_costs.Rates, quick: bool, toy: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """The kda and kda_cp2 points of every prompt length that fits in memory, and notes on those skipped."""
    heads, dim, block = (TOY["heads"], TOY["dim"], TOY["block"]) if toy else (HEADS, DIM, BLOCK)
    points, notes = [], []
    for seq in TOY["contexts"] if toy else CONTEXTS[quick]:
        need, free = needed_bytes(seq, heads, dim), available_bytes()
        if need > 0.7 * free:
            notes.append(f"kda at {seq} tokens skipped: one process needs ~{need / 2**30:.0f} GiB, "
                         f"{free / 2**30:.0f} GiB available")
            continue
        points += pair(seq, heads, dim, block, rates)
    return points, notes


def pair(seq: int, heads: int, dim: int, block: int, rates: context_costs.Rates) -> list[dict[str, Any]]:
    """One process, then two ranks, on the same prompt."""
    folder = Path(tempfile.mkdtemp(prefix="ascend_dsa_kda_"))
    try:
        reference = str(folder / "outputs.bf16")
        common = (seq, heads, dim, block, SEED, reference)
        [one] = launch(kda_prefill.one_process, 1, args=common, timeout_s=LAUNCH_TIMEOUT_S)
        threads = max(1, torch.get_num_threads() // 2)
        ranks = launch(kda_prefill.split_rank, 2, args=(*common, threads), timeout_s=LAUNCH_TIMEOUT_S)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return [single_point(seq, heads, dim, one, rates), split_point(seq, heads, dim, one, ranks, rates)]


def _base(row: str, seq: int, heads: int, dim: int, seconds: float, work: context_costs.Work,
          rates: context_costs.Rates) -> dict[str, Any]:
    floor_s = work.floor_s(rates.bandwidth, rates.gemm_rate)
    return {"phase": "prefill", "row": row, "context": seq, "tokens": seq, "ms": 1e3 * seconds,
            "floor_ms": 1e3 * floor_s, "ratio_to_floor": seconds / floor_s, "cache_bytes": heads * dim * dim * 4}


def single_point(seq: int, heads: int, dim: int, one: dict[str, Any],
                 rates: context_costs.Rates) -> dict[str, Any]:
    work = context_costs.kda_work(seq, heads, dim, dim)
    return {**_base("kda", seq, heads, dim, one["seconds"], work, rates), "ranks": 1,
            "peak_bytes": one["peak_bytes"], "peak_rss_bytes": one["peak_rss_bytes"], "threads": one["threads"]}


def split_point(seq: int, heads: int, dim: int, one: dict[str, Any], ranks: list[dict[str, Any]],
                rates: context_costs.Rates) -> dict[str, Any]:
    n = len(ranks)
    work = context_costs.kda_split_work(seq, heads, dim, dim)
    slowest = max(ranks, key=lambda r: r["seconds"])
    peak = max(r["peak_bytes"] for r in ranks)
    state = one["final_state"]
    return {**_base(f"kda_cp{n}", seq, heads, dim, slowest["seconds"], work, rates), "ranks": n,
            "peak_bytes": peak, "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
            "peak_bytes_per_rank": [r["peak_bytes"] for r in ranks], "peak_ratio": peak / one["peak_bytes"],
            "rel_diff": math.sqrt(sum(r["diff_sq"] for r in ranks) / sum(r["norm_sq"] for r in ranks)),
            "state_rel_diff": max(float((r["final_state"] - state).norm() / state.norm()) for r in ranks),
            "threads": slowest["threads"], "parts_ms": {k: 1e3 * v for k, v in slowest["clock"].items()},
            "model_ms": time_model(seq, slowest)}


def time_model(seq: int, rank: dict[str, Any]) -> dict[str, float]:
    """{N: ms} to first token with N ranks (module docstring), from one rank's measured parts."""
    clock, tokens, measured_ranks = rank["clock"], rank["tokens"], seq // rank["tokens"]
    per_token = (clock["transition"] + clock["outputs"]) / tokens
    return {str(n): 1e3 * (per_token * seq / n + clock["exchange"] * n / measured_ranks) for n in MODEL_RANKS}

"""`ascend-dsa bench cp`: work balance and communication of context parallelism.

Causal rows: the work per CP rank of a causal prefill, per query position p (from 0): p + 1 keys for the
lightning indexer (and dense causal attention), min(p + 1, top-k) rows for sparse attention. Each rank's
share comes from npu_graph.parallel.zigzag_split of the per-position work, against a contiguous split; the
figure is max/mean over ranks (1.0 = perfect balance; target for zigzag <= 1.01). The DSA all-gather is what
one rank receives: the other ranks' indexer keys, MLA latents and RoPE keys (fp32).

KDA rows: npu_graph.parallel.kda_split on contiguous slices. The work fraction is one rank's work over the
single-process run: by a FLOP model of the chunked form the NPU runs (per chunk of C steps and head: decayed
grams 4C²K, the triangular inverse C³/3, its application 2C²(V + K), the state scan 4CKV, the outputs 2CKV +
2C²V), where a rank runs T/cp steps with V + K value columns, then the correction Q̃ S (2KV per step) and the
fold; and measured, as the median time of a rank's local work (its fused call with the extra columns, the fold
and the correction, in this process) over one single-process chunk_kda call. On a CPU with the native recurrence
(cost linear in the value columns) a rank with V + K columns does (T/cp)(V + K)/V of the work, 2/cp for K = V,
so the measured fraction sits above the FLOP model's. Ideal is 1/cp. Communication is
the one all-gather of [Z | A] per slice, B·H·K·(V + K) fp32 values from each rank.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

from npu_graph.models.hybrid import HybridConfig
from npu_graph.observe import progress
from npu_graph.parallel import zigzag_split
from npu_graph.parallel.kda_split import correct_outputs, fold_states, run_slice
from npu_graph.tools.timing import time_side_by_side

CP_SIZES = (2, 4, 8)
FP32_BYTES = 4


def _max_over_mean(per_rank: list[float]) -> float:
    return max(per_rank) / (sum(per_rank) / len(per_rank))


def _balance(work: torch.Tensor, cp: int) -> tuple[float, float]:
    """max/mean of per-rank work under the zigzag and the contiguous split of per-position `work`."""
    zigzag = [float(zigzag_split(work, cp, r, dim=0).sum()) for r in range(cp)]
    contiguous = [float(part.sum()) for part in work.chunk(cp)]
    return _max_over_mean(zigzag), _max_over_mean(contiguous)


def causal_rows(seq: int, config: HybridConfig) -> list[dict[str, Any]]:
    positions = torch.arange(seq, dtype=torch.float64)
    causal, sparse = positions + 1, (positions + 1).clamp(max=config.index_topk)
    per_token = config.index_head_dim + config.kv_lora_rank + config.qk_rope_head_dim
    rows = []
    for cp in CP_SIZES:
        zigzag, contiguous = _balance(causal, cp)
        sparse_zigzag, sparse_contiguous = _balance(sparse, cp)
        rows.append({"case": f"causal T={seq} cp={cp}", "causal_keys_per_rank": float(causal.sum()) / cp,
                     "zigzag_max_over_mean": zigzag, "contiguous_max_over_mean": contiguous,
                     "zigzag_meets_1.01": zigzag <= 1.01, "sparse_zigzag_max_over_mean": sparse_zigzag,
                     "sparse_contiguous_max_over_mean": sparse_contiguous,
                     "dsa_allgather_bytes_per_rank": (cp - 1) * seq // cp * per_token * FP32_BYTES})
    return rows


def chunk_kda_flops(seq: int, heads: int, dim_k: int, dim_v: int, chunk: int) -> float:
    """FLOP model of one chunk_kda call (see the module docstring)."""
    per_chunk = (4 * chunk ** 2 * dim_k + chunk ** 3 / 3 + 2 * chunk ** 2 * (dim_v + dim_k)
                 + 6 * chunk * dim_k * dim_v + 2 * chunk ** 2 * dim_v)
    return -(-seq // chunk) * heads * per_chunk


def _kda_inputs(seq: int, heads: int, dim: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (1, seq, heads, dim)
    q, k = (F.normalize(torch.randn(shape, generator=g), dim=-1) for _ in range(2))
    return [q, k, torch.randn(shape, generator=g), -torch.rand(shape, generator=g) * 0.1,
            torch.rand(1, seq, heads, generator=g)]


def _rank_work(inputs: list[torch.Tensor], cp: int, chunk: int) -> None:
    """The local work of the last rank of cp: its slice's fused run, the fold over cp transitions, the
    correction (the all-gather itself is not timed)."""
    run = run_slice(*(x.tensor_split(cp, dim=1)[-1] for x in inputs), chunk_size=chunk)
    states = fold_states([run.transition] * cp, torch.zeros(*run.transition.shape[:-1], inputs[2].shape[-1]))
    correct_outputs(run, states[-2])


def kda_rows(seq: int, heads: int, dim: int, chunk: int, repeat: int) -> list[dict[str, Any]]:
    inputs = _kda_inputs(seq, heads, dim)
    candidates = {"single": lambda: torch.ops.ascend_dsa.chunk_kda(*inputs, chunk_size=chunk)}
    for cp in CP_SIZES:
        candidates[f"cp{cp}"] = lambda cp=cp: _rank_work(inputs, cp, chunk)
    times = time_side_by_side(candidates, repeat=repeat, warmup=1)
    single = chunk_kda_flops(seq, heads, dim, dim, chunk)
    rows = []
    for cp in CP_SIZES:
        local = seq // cp
        flops = (chunk_kda_flops(local, heads, dim, 2 * dim, chunk) + 2 * local * heads * dim * dim
                 + 2 * cp * heads * dim * dim * dim)
        measured = times[f"cp{cp}"] / times["single"]
        rows.append({"case": f"kda split T={seq} H={heads} K=V={dim} cp={cp}", "ideal_fraction": 1 / cp,
                     "work_fraction_flops": flops / single, "work_fraction_measured": measured,
                     "allgather_bytes_sent_per_rank": heads * dim * 2 * dim * FP32_BYTES,
                     "allgather_bytes_received_per_rank": (cp - 1) * heads * dim * 2 * dim * FP32_BYTES})
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = HybridConfig.named("ctx16k")
    seq = 4096 if args.quick else 16384
    repeat = args.repeat or (3 if args.quick else 5)
    with progress.step(f"causal work per rank at {seq} tokens", "bench cp"):
        rows = causal_rows(seq, config)
    with progress.step(f"KDA split at {seq} tokens", "bench cp"):
        rows += kda_rows(seq, config.kda_num_heads, config.kda_head_dim, 64, repeat)
    return {"suite": "cp", "rows": rows,
            "notes": ["causal: max/mean of per-rank work (1.0 = balanced); zigzag target <= 1.01",
                      f"sizes from HybridConfig 'ctx16k' (index_topk={config.index_topk}, "
                      f"KDA {config.kda_num_heads} heads of {config.kda_head_dim}); batch 1",
                      "kda work_fraction: one rank's work / the single-process run; ideal 1/cp; the extra K "
                      "value columns that give the exact correction cost the rest",
                      "work_fraction_measured: medians timed side by side in one process (noisy on a shared "
                      "machine)"]}

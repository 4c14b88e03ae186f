"""`ascend-dsa bench kernels`: every fused op against the unfused form it replaces, timed side by side.

Cases come from bench_kernels_dsa (indexer, sparse attention), bench_kernels_kda (chunk_kda, attn_res, MoE)
and bench_kernels_quant (quantization, NZ, RMSNorm). Each row reports the medians, the speedup of ours over
the baseline, the targets and whether they are met in this run; quant rows add throughput (elements/s)
next to a plain fp32 copy of the same tensor.
"""
from __future__ import annotations

import argparse
from typing import Any

from npu_graph.kernels.native import dispatch
from npu_graph.observe import progress
from npu_graph.tools import bench_kernels_dsa, bench_kernels_kda, bench_kernels_quant
from npu_graph.tools.timing import time_side_by_side

SUITES = (bench_kernels_dsa, bench_kernels_kda, bench_kernels_quant)


def _targets_met(case: dict[str, Any], medians: dict[str, float]) -> dict[str, bool]:
    ours = medians[case["ours"]]
    met = {}
    for name, target in case.get("targets", {}).items():
        if name.startswith("speedup_vs_"):
            met[name] = medians[name.removeprefix("speedup_vs_")] / ours >= target
        elif name == "time_vs_gemm_max":
            met[name] = ours / medians[case["gemm"]] <= target
    return met


def measure(case: dict[str, Any], repeat: int) -> dict[str, Any]:
    rounds = min(repeat, case.get("repeat", repeat))
    dispatch.take_used()
    medians = time_side_by_side(case["candidates"], repeat=rounds, warmup=1)
    impl = dispatch.take_used()
    ours, baseline = medians[case["ours"]], medians[case["baseline"]]
    row: dict[str, Any] = {"case": case["name"], "impl": impl,
                           **{f"{k}_ms": v * 1e3 for k, v in medians.items()},
                           f"speedup_vs_{case['baseline']}": baseline / ours}
    for label, seconds in medians.items():
        if label not in (case["ours"], case["baseline"]):
            row[f"ours_vs_{label}"] = seconds / ours
    if "elements" in case:
        row["ours_elements_per_s"] = case["elements"] / ours
        row["copy_elements_per_s"] = case["elements"] / baseline
    if case.get("targets"):
        row["targets"] = case["targets"]
        row["targets_met"] = _targets_met(case, medians)
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    repeat = args.repeat or (3 if args.quick else 9)
    rows = []
    for suite in SUITES:
        for case in suite.cases():
            with progress.step(case["name"], "bench kernels"):
                rows.append(measure(case, repeat))
    return {"suite": "kernels", "rows": rows,
            "notes": ["ratios are medians of candidates alternated round by round in this run",
                      "speedup_vs_X = X's median / ours; ours_vs_X = X's median / ours (both > 1: ours faster)"]}

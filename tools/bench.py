"""`ascend-dsa bench SUITE`: run a benchmark suite and print its table or JSON.

A suite is a function `run(args) -> dict` returning {"suite", "rows": [...], "notes": [...]}; each row is a
flat dict of measured figures. Timings inside a suite are taken side by side (tools.timing).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from npu_graph.kernels.native import cpu_isa, dispatch

SUITES = {
    "e2e": "npu_graph.tools.bench_e2e",
    "kernels": "npu_graph.tools.bench_kernels",
    "cache": "npu_graph.tools.bench_cache",
    "quant": "npu_graph.tools.bench_quant",
    "cp": "npu_graph.tools.bench_cp",
    "generate": "npu_graph.tools.bench_generate",
    "spec": "npu_graph.tools.bench_spec",
    "ep": "npu_graph.tools.bench_ep",
    "fleet": "npu_graph.tools.bench_fleet",
    "fusion": "npu_graph.tools.bench_fusion",
    "context": "npu_graph.tools.bench_context",
    "serve": "npu_graph.tools.bench_serve",
}


def cpu_name() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    names = [line.split(":", 1)[1].strip() for line in cpu_isa.cpuinfo_lines() if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    return {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine(), "cpu": cpu_name(), "isa_levels": list(cpu_isa.supported()),
            "native_mode": dispatch.mode()}


def print_table(result: dict[str, Any], console: Console) -> None:
    rows = result["rows"]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    machine = result.get("machine", {})
    table = Table(title=f"ascend-dsa bench {result['suite']} — {machine.get('cpu', '?')}, native kernels at "
                        f"{result.get('isa', '?')} ({machine.get('native_mode', '?')})")
    for column in columns:
        table.add_column(column, justify="left" if column in ("case", "backend", "candidate") else "right")
    for row in rows:
        table.add_row(*[_cell(row.get(c)) for c in columns])
    console.print(table)
    for note in result.get("notes", []):
        console.print(f"- {note}")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return "" if value is None else str(value)


def _refused_level(args: argparse.Namespace) -> str | None:
    """Why the native kernels cannot be timed at the level asked for (--isa, ASCEND_DSA_AMX_EMULATED), or None;
    sets ASCEND_DSA_CPU_ISA to --isa."""
    try:
        if cpu_isa.amx_emulated():
            return (f"{cpu_isa.ENV_AMX_EMULATED}=1 emulates the AMX tile instructions for tests; timings under it "
                    "mean nothing: unset it to benchmark")
        if getattr(args, "isa", None):
            os.environ[cpu_isa.ENV_ISA] = cpu_isa.check_level(args.isa)
    except cpu_isa.IsaError as e:
        return str(e)
    return None


def run_bench(args: argparse.Namespace) -> int:
    if args.suite not in SUITES:
        print(f"unknown bench suite {args.suite!r}; choose one of {sorted(SUITES)}", file=sys.stderr)
        return 2
    refused = _refused_level(args)
    if refused:
        print(f"ascend-dsa bench: {refused}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUITES[args.suite])
    result = {"isa": cpu_isa.active(), **module.run(args)}
    result["machine"] = machine_info()
    if getattr(args, "plot", None) and hasattr(module, "write_plot"):     # a suite that draws its figures
        module.write_plot(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    elif hasattr(module, "print_text"):     # a suite with too many columns for a table prints its own lines
        module.print_text(result)
    else:
        print_table(result, Console())
    return 0

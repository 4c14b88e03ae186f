"""`ascend-dsa bench fleet`: ranks starting cold on one shared compile cache, against one rank alone.

The fleet is 4 ranks, 2 simulated nodes × 2 processes: two torchrun invocations against one c10d rendezvous
endpoint on this host, every rank with the same compile cache and Inductor cache, both empty. Each rank compiles
the tiny reference model and answers a prompt of its own (tools/fleet_rank.py); the lone process, one rank under
torchrun (`--standalone --nproc-per-node 1`) on caches of its own, empty too, answers every rank's prompt. Both
run as torchrun starts them, so Dynamo's traces are shared as they are there by default (npu_graph.cache.traces).
Before both, one process fills the native kernels' build folder and dispatch measurements (a one-time cost per
machine, not per graph). Every process runs one thread (torchrun's default for several processes per node), so
CPU-seconds compare.

Reported: per rank, the wall seconds to its first output, the CPU-seconds from torch.compile to it (and to the
stored trace, for the rank that made it) and the part of them inside the backend, its cache decisions and whether
it traced the model or loaded the trace; `fleet_compile_cpu_s`, the sum of the ranks' CPU-seconds, against
`single_rank_compile_s`, the lone process's; `outputs_equal`: every rank's output equals the lone process's for
that prompt, bit for bit.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from npu_graph.observe import progress
from npu_graph.parallel.torchrun_copies import free_port, run_copies
from npu_graph.tools import fleet_rank

NODES, PER_NODE = 2, 2
TIMEOUT_S = 1800


def _environment(root: Path, name: str, cold: bool) -> dict[str, str]:
    """Empty compile and Inductor caches of their own (with `cold`, native kernels too); one thread; no status
    lines."""
    env = dict(os.environ, ASCEND_DSA_CACHE_DIR=str(root / name / "cache"), OMP_NUM_THREADS="1",
               TORCHINDUCTOR_CACHE_DIR=str(root / name / "inductor"), ASCEND_DSA_PROGRESS="0")
    if cold:
        env["ASCEND_DSA_NATIVE_DIR"] = str(root / name / "native")
    return env


def _run(command: list[str], logs: list[Path], env: dict[str, str], what: str) -> None:
    codes = run_copies(command, logs, env, TIMEOUT_S)
    if any(codes):
        tail = "\n".join(log.read_text()[-1500:] for log in logs)
        raise RuntimeError(f"bench fleet: the {what} failed (exit codes {codes}):\n{tail}")


def _single(root: Path, name: str, prompts: int, cold: bool = False) -> None:
    out = root / name
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               fleet_rank.__file__, str(out), str(prompts)]
    _run(command, [out / "log"], _environment(root, name, cold), f"{name} process")


def _fleet(root: Path, cold: bool) -> None:
    out = root / "fleet"
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node",
               str(PER_NODE), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
               "--rdzv-id", "ascend-dsa-bench-fleet", "--max-restarts", "0", fleet_rank.__file__, str(out), "1"]
    logs = [out / f"node{node}.log" for node in range(NODES)]
    _run(command, logs, _environment(root, "fleet", cold), "torchrun fleet")


def _read(folder: Path, name: str) -> tuple[dict[str, Any], dict[int, torch.Tensor]]:
    return json.loads((folder / f"{name}.json").read_text()), torch.load(folder / f"{name}.pt")


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ascend_dsa_bench_fleet_") as root:
        return _measure(Path(root), bool(getattr(args, "cold", False)))


def _measure(root: Path, cold: bool) -> dict[str, Any]:
    ranks = NODES * PER_NODE
    if not cold:
        with progress.step("native kernels and dispatch measurements, once for the machine", "bench fleet"):
            _single(root, "prepare", 1)
    with progress.step("one rank alone, cold", "bench fleet"):
        _single(root, "single", ranks, cold)
    with progress.step(f"{ranks} ranks (2 simulated nodes × {PER_NODE}) under torchrun, cold on one cache",
                       "bench fleet"):
        _fleet(root, cold)
    single, single_out = _read(root / "single", "single")
    rows, equal = [{"case": "one rank alone", **_figures(single)}], True
    for rank in range(ranks):
        figures, out = _read(root / "fleet", f"rank{rank}")
        rows.append({"case": f"fleet rank {rank} (node {rank // PER_NODE})", **_figures(figures)})
        equal = equal and torch.equal(out[rank], single_out[rank])
    fleet_cpu = sum(row["compile_cpu_s"] for row in rows[1:])
    return {"suite": "fleet", "ranks": ranks, "native_kernels": "built by the run" if cold else "built beforehand",
            "single_rank_compile_s": single["compile_cpu_s"],
            "single_rank_first_output_s": single["first_output_s"], "fleet_compile_cpu_s": fleet_cpu,
            "fleet_over_single": fleet_cpu / single["compile_cpu_s"], "outputs_equal": equal, "rows": rows,
            "notes": ["compile_cpu_s: CPU-seconds from torch.compile to the first output (Dynamo's tracing or the "
                      "load of a shared trace, the backend, the run), and storing the trace for the rank that made "
                      "it; backend_cpu_s: the part inside the backend (key, lease, load or compile; for a loaded "
                      "trace, its graphs loaded from their entries)",
                      f"fleet_compile_cpu_s = the ranks' compile_cpu_s summed = {fleet_cpu:.1f}; one rank alone "
                      f"{single['compile_cpu_s']:.1f} ({fleet_cpu / single['compile_cpu_s']:.2f}×); every output "
                      f"equals the lone process's: {equal}"]}


def _figures(record: dict[str, Any]) -> dict[str, Any]:
    return {"first_output_s": record["first_output_s"], "compile_cpu_s": record["compile_cpu_s"],
            "backend_cpu_s": record["backend_cpu_s"], "cache": ",".join(record["cache"]), "trace": record["trace"]}

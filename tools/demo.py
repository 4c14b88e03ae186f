"""`ascend-dsa demo`: compile the reference model on CPU, run prefill and greedy decode eagerly and
compiled, and show what the compiler did (passes, node counts, fused ops, errors, latency, cache, dump)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import npu_graph
from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.report import GraphReport
from npu_graph.tools.html_report import write_html_report


@dataclass
class Run:
    """Logits and latencies of one prefill + greedy decode."""

    logits: list[torch.Tensor] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: list[float] = field(default_factory=list)


def generate_side_by_side(models: dict[str, Any], ids: torch.Tensor, steps: int,
                          caches: dict[str, Any]) -> dict[str, Run]:
    """Prefill + greedy decode of every model in lockstep, each on its own cache and its own greedy tokens:
    each step runs all models one after the other, so machine noise shifts their latencies alike."""
    runs = {name: Run() for name in models}
    tokens = dict.fromkeys(models, ids)
    with torch.no_grad():
        for step in range(steps + 1):
            for name, model in models.items():
                start = time.perf_counter()
                logits = model(tokens[name], caches[name])[:, -1]
                elapsed = time.perf_counter() - start
                run = runs[name]
                if step == 0:
                    run.prefill_s = elapsed
                else:
                    run.decode_s.append(elapsed)
                run.logits.append(logits)
                tokens[name] = logits.argmax(-1, keepdim=True)
                run.tokens.append(int(tokens[name][0, 0]))
    return runs


def _graphs_table(reports: list[GraphReport]) -> Table:
    table = Table(title="graphs compiled by ascend_dsa")
    for column in ("graph", "nodes before → after", "passes that changed it", "fused ops", "cache", "compile ms"):
        table.add_column(column)
    for r in reports:
        changed = ", ".join(p["name"] for p in r.passes if p["changed"]) or "-"
        fused = ", ".join(f"{op}×{n}" for op, n in r.fused_ops.items()) or "-"
        table.add_row(r.name, f"{r.nodes_before} → {r.nodes_after}", changed, fused,
                      r.cache if r.cache == "hit" or not r.cache_reason else f"{r.cache}: {r.cache_reason}",
                      f"{r.timings_ms.get('compile', 0):.0f}")
    return table


def _results(eager: Run, compiled: Run, reports: list[GraphReport], dump_dir: str) -> dict[str, Any]:
    diffs = [(a - b).abs().max().item() for a, b in zip(eager.logits, compiled.logits)]
    return {
        "max_abs_diff_prefill": diffs[0],
        "max_abs_diff_decode": max(diffs[1:], default=0.0),
        "greedy_tokens_equal": eager.tokens == compiled.tokens,
        "eager_prefill_ms": eager.prefill_s * 1e3,
        "compiled_first_prefill_ms": compiled.prefill_s * 1e3,
        "eager_decode_ms": statistics.median(eager.decode_s) * 1e3,
        "compiled_decode_ms": statistics.median(compiled.decode_s[1:] or compiled.decode_s) * 1e3,
        "graphs": [r.to_json() for r in reports],
        "dump_dir": dump_dir,
    }


def _print_results(console: Console, results: dict[str, Any], reports: list[GraphReport]) -> None:
    console.print(_graphs_table(reports))
    table = Table(title="compiled vs eager")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("max |compiled − eager| logits, prefill", f"{results['max_abs_diff_prefill']:.2e}")
    table.add_row("max |compiled − eager| logits, decode", f"{results['max_abs_diff_decode']:.2e}")
    table.add_row("greedy tokens identical", str(results["greedy_tokens_equal"]))
    table.add_row("prefill eager ms", f"{results['eager_prefill_ms']:.1f}")
    table.add_row("decode step eager ms (median)", f"{results['eager_decode_ms']:.1f}")
    table.add_row("decode step compiled ms (median)", f"{results['compiled_decode_ms']:.1f}")
    console.print(table)
    console.print(f"dump: {results['dump_dir']}")
    console.print(f"HTML report: {results['html_report']}  (also: ascend-dsa inspect {results['dump_dir']})")


def run_demo(args: argparse.Namespace) -> int:
    console = Console(stderr=args.json)
    dump_dir = args.dump_dir or tempfile.mkdtemp(prefix="ascend_dsa_demo_")
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named(args.config)).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    backend = npu_graph.get_backend({"dump_dir": dump_dir, "cache": not args.no_cache})
    before = len(backend.reports)
    models = {"eager": model, "compiled": torch.compile(model, backend=backend)}
    with console.status("running eager and compiled side by side (first calls compile the prefill and decode "
                        "graphs) ..."):
        runs = generate_side_by_side(models, ids, args.steps, {name: model.new_cache(1) for name in models})
    eager, compiled = runs["eager"], runs["compiled"]
    reports = backend.reports[before:]
    results = _results(eager, compiled, reports, dump_dir)
    results["html_report"] = write_html_report(dump_dir, os.path.join(dump_dir, "report.html"))
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    else:
        _print_results(console, results, reports)
    return 0

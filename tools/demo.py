"""`ascend-dsa demo`: compile the reference model on CPU, run prefill and greedy decode eagerly and
compiled, and show what the compiler did (passes, node counts, fused ops, errors, latency, cache, dump).

By default the model is the trained checkpoint (`--config stdlib`; when `ascend-dsa train` has not made one, a
one-minute one is trained in a child process while the demo compiles its graphs, npu_graph.training.background),
prompted with held-out text, and the demo also shows its continuations
eager vs compiled vs quant="dsa" (tools/demo_text.py); other configs and `--random-weights` run a seeded random
model on a random prompt.

The tables fit an 80-column terminal (and a pipe, which rich gives 80 columns): one pass and one fused op per
line, never cut short.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import npu_graph
from npu_graph.models.checkpoint import CheckpointError
from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.observe import progress
from npu_graph.observe.report import GraphReport
from npu_graph.tools import demo_text, trained_accuracy
from npu_graph.tools.html_report import write_html_report
from npu_graph.training import background
from npu_graph.training.background import BackgroundTraining

PREFILL_ROUNDS = 3  # warm prefills of each model, alternated, for the compiled-vs-eager prefill time
TRAINED_CONFIG = "stdlib"   # the config the demo runs as a trained checkpoint (npu_graph.training)
TEXT_PROMPTS, TEXT_STEPS = 3, 48


@dataclass
class Run:
    """Logits and latencies of one prefill + greedy decode."""

    logits: list[torch.Tensor] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: list[float] = field(default_factory=list)


class SideBySide:
    """Prefill + greedy decode of every model in lockstep, each on its own cache and its own greedy tokens:
    each step runs all models one after the other, so machine noise shifts their latencies alike."""

    def __init__(self, models: dict[str, Any], ids: torch.Tensor, caches: dict[str, Any]) -> None:
        self.models, self.caches = models, caches
        self.runs = {name: Run() for name in models}
        self.tokens = dict.fromkeys(models, ids)
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        """One step of every model: the prefill first, then one decode step per call."""
        for name, model in self.models.items():
            start = time.perf_counter()
            logits = model(self.tokens[name], self.caches[name])[:, -1]
            elapsed = time.perf_counter() - start
            run = self.runs[name]
            if self.steps == 0:
                run.prefill_s = elapsed
            else:
                run.decode_s.append(elapsed)
            run.logits.append(logits)
            self.tokens[name] = logits.argmax(-1, keepdim=True)
            run.tokens.append(int(self.tokens[name][0, 0]))
        self.steps += 1


@torch.no_grad()
def warm_prefill_ms(models: dict[str, Any], new_cache: Any, ids: torch.Tensor,
                    rounds: int = PREFILL_ROUNDS) -> dict[str, float]:
    """Median prefill time of each (already compiled) model on fresh caches, models alternated per round."""
    samples: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            cache = new_cache()
            start = time.perf_counter()
            models[name](ids, cache)
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(times) for name, times in samples.items()}


def graphs_table(reports: list[GraphReport]) -> Table:
    """One row per graph: what it is, the passes that changed it, its fused ops (one per line)."""
    table = Table(title="graphs compiled by ascend_dsa")
    table.add_column("graph", overflow="fold")
    table.add_column("passes that changed it", no_wrap=True, overflow="fold")
    table.add_column("fused ops", no_wrap=True, overflow="fold")
    for r in reports:
        cache = r.cache if r.cache == "hit" or not r.cache_reason else f"{r.cache}: {r.cache_reason}"
        about = "\n".join([r.name, f"{r.nodes_before} → {r.nodes_after} nodes", f"cache {cache}",
                           f"compile {r.timings_ms.get('compile', 0):.0f} ms"])
        changed = "\n".join(p["name"] for p in r.passes if p["changed"]) or "-"
        fused = "\n".join(f"{op} ×{n}" for op, n in r.fused_ops.items()) or "-"
        table.add_row(about, changed, fused, end_section=True)
    return table


def timing_table(results: dict[str, Any]) -> Table:
    """Prefill and decode step, eager next to compiled, and the first (compiling) call."""
    table = Table(title="eager vs ascend_dsa")
    table.add_column("ms", overflow="fold")
    for column in ("eager", "ascend_dsa", "speedup"):
        table.add_column(column, justify="right")
    for label, key in ((f"prefill (median of {PREFILL_ROUNDS})", "prefill_ms"),
                       ("decode step (median)", "decode_ms")):
        eager, compiled = results[f"eager_{key}"], results[f"compiled_{key}"]
        table.add_row(label, f"{eager:.1f}", f"{compiled:.1f}", f"{eager / compiled:.2f}x")
    table.add_row("first prefill (compiles)", f"{results['eager_first_prefill_ms']:.1f}",
                  f"{results['compiled_first_prefill_ms']:.1f}", "")
    return table


def accuracy_table(results: dict[str, Any]) -> Table:
    table = Table(title="compiled vs eager results")
    table.add_column("measure", overflow="fold")
    table.add_column("value", justify="right")
    table.add_row("max |compiled − eager| logits, prefill", f"{results['max_abs_diff_prefill']:.2e}")
    table.add_row("max |compiled − eager| logits, decode", f"{results['max_abs_diff_decode']:.2e}")
    table.add_row("greedy tokens identical", str(results["greedy_tokens_equal"]))
    return table


def results_of(eager: Run, compiled: Run, prefill_ms: dict[str, float], reports: list[GraphReport],
               dump_dir: str) -> dict[str, Any]:
    diffs = [(a - b).abs().max().item() for a, b in zip(eager.logits, compiled.logits)]
    return {
        "max_abs_diff_prefill": diffs[0],
        "max_abs_diff_decode": max(diffs[1:], default=0.0),
        "greedy_tokens_equal": eager.tokens == compiled.tokens,
        "eager_prefill_ms": prefill_ms["eager"],
        "compiled_prefill_ms": prefill_ms["compiled"],
        "eager_first_prefill_ms": eager.prefill_s * 1e3,
        "compiled_first_prefill_ms": compiled.prefill_s * 1e3,
        "eager_decode_ms": statistics.median(eager.decode_s) * 1e3,
        "compiled_decode_ms": statistics.median(compiled.decode_s[1:] or compiled.decode_s) * 1e3,
        "graphs": [r.to_json() for r in reports],
        "dump_dir": dump_dir,
    }


def print_results(console: Console, results: dict[str, Any], reports: list[GraphReport]) -> None:
    console.print(graphs_table(reports))
    console.print(timing_table(results))
    console.print(accuracy_table(results))
    console.print(f"dump: {results['dump_dir']}", soft_wrap=True)
    console.print(f"HTML report: {results['html_report']}  (also: ascend-dsa inspect {results['dump_dir']})",
                  soft_wrap=True)


def _run_side_by_side(models: dict[str, Any], model: HybridLM, ids: torch.Tensor, steps: int,
                      compiled_already: bool) -> SideBySide:
    runner = SideBySide(models, ids, {name: model.new_cache(1) for name in models})

    def compiles(note: str) -> str:
        return "" if compiled_already else f" ({note})"

    with progress.step(f"prefill, eager then compiled{compiles('the first compiled call compiles the prefill graph')}",
                       "demo"):
        runner.step()
    with progress.step(f"first decode step{compiles('compiles the decode graph')}", "demo"):
        runner.step()
    if steps > 1:
        with progress.step(f"{steps - 1} more decode steps", "demo"):
            for _ in range(steps - 1):
                runner.step()
    return runner


def _model_and_prompts(args: argparse.Namespace, config: HybridConfig
                       ) -> tuple[HybridLM, BackgroundTraining | None, torch.Tensor]:
    """The trained checkpoint (or, when there is none, an untrained model of its config and the training that
    will fill it in) and held-out prompts [TEXT_PROMPTS, L] (config stdlib), else a seeded random model and one
    random prompt."""
    if args.config == TRAINED_CONFIG and not args.random_weights:
        prompts = trained_accuracy.heldout_data(TEXT_PROMPTS)[:, :-1]
        # contiguous: a row of a slice keeps the slice's row stride, which Dynamo guards on even for one row
        return *background.quick_model(TRAINED_CONFIG), prompts[:, -args.prompt_len:].contiguous()
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    return HybridLM(config).eval(), None, ids


def _compile_while_training(training: BackgroundTraining, compiled: Any, quantized: Any, model: HybridLM,
                            ids: torch.Tensor) -> float:
    """The demo's graphs compiled on the untrained model while the checkpoint trains, then its weights loaded
    into the model; returns the first compiled call's (prefill-compiling) milliseconds."""
    with training:
        with progress.step("compiling the demo's graphs while the checkpoint trains", "demo"):
            seconds = demo_text.warm(compiled, model, ids)
            if quantized is not None:
                demo_text.warm(quantized, model, ids, torch.float8_e4m3fn)
        with progress.step("loading the trained weights (waiting for the training to finish)", "demo"):
            training.load_into(model)
    return seconds * 1e3


def _config_or_error(args: argparse.Namespace) -> HybridConfig | None:
    try:
        config = HybridConfig.named(args.config)
    except ValueError as exc:
        print(f"ascend-dsa demo: error: {exc} (--config)", file=sys.stderr)
        return None
    args.prompt_len = args.prompt_len or min(512, config.max_context // 2)
    if args.prompt_len + args.steps > config.max_context:
        print(f"ascend-dsa demo: error: --prompt-len {args.prompt_len} + --steps {args.steps} exceeds the "
              f"{args.config!r} model's context of {config.max_context} tokens; ask for fewer", file=sys.stderr)
        return None
    return config


def run_demo(args: argparse.Namespace) -> int:
    """Run `ascend-dsa demo`; 2 when the arguments name no model config or do not fit its context."""
    config = _config_or_error(args)
    if config is None:
        return 2
    dump_dir = args.dump_dir or tempfile.mkdtemp(prefix="ascend_dsa_demo_")
    model, training, prompts = _model_and_prompts(args, config)
    ids = prompts[:1].clone()     # a tensor of its own, as each continuation's prompt is (demo_text)
    backend = npu_graph.get_backend({"dump_dir": dump_dir, "cache": not args.no_cache})
    before = len(backend.reports)
    models = {"eager": model, "compiled": torch.compile(model, backend=backend)}
    quantized = demo_text.quantized(model) if prompts.shape[0] > 1 else None
    first_ms = None
    if training is not None:
        try:
            first_ms = _compile_while_training(training, models["compiled"], quantized, model, ids)
        except CheckpointError as exc:
            print(f"ascend-dsa demo: error: {exc}", file=sys.stderr)
            return 1
    runner = _run_side_by_side(models, model, ids, args.steps, compiled_already=training is not None)
    with progress.step("prefill again, eager and compiled alternately (no compiling)", "demo"):
        prefill_ms = warm_prefill_ms(models, lambda: model.new_cache(1), ids)
    texts = None
    if quantized is not None:
        with progress.step("held-out prompts continued: eager, compiled, compiled with quant='dsa'", "demo"):
            texts = demo_text.continuations(model, prompts, TEXT_STEPS, models["compiled"], quantized)
    reports = backend.reports[before:]
    results = results_of(runner.runs["eager"], runner.runs["compiled"], prefill_ms, reports, dump_dir)
    if first_ms is not None:  # the graphs were compiled while the checkpoint trained
        results["compiled_first_prefill_ms"] = first_ms
    results["html_report"] = write_html_report(dump_dir, os.path.join(dump_dir, "report.html"))
    results["text"] = demo_text.text_results(prompts, texts) if texts else None
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    else:
        print_results(Console(), results, reports)
        if texts:
            Console().print(demo_text.text_table(prompts, texts))
    return 0

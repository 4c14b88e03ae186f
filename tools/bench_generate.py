"""`ascend-dsa bench generate`: transformers `model.generate()` (greedy, a fixed number of new tokens) of the tiny
random-config families (64-token prompt, 32 new tokens) and of mid-size DeepSeek-V3.2 and Kimi Linear configs
(MID: 1024-token prompt, 16 new tokens) in eager, Inductor and ascend_dsa, rounds alternating backends
(tools.timing), each compiled backend on a model copy (same weights) and a `forward` frame of its own.

Method. `model.forward` is replaced by a recorder around the (compiled) forward: it notes each call's start and
end and the graphs Dynamo compiled during it. In one generate() of N new tokens the first forward is the prefill
(prompt, empty DynamicCache) and the N-1 others are decode steps, so per timed generate():
  prefill_ms   = the first forward's wall time (generate()'s own setup before it is left out);
  decode_tok_s = (N - 1) / (end of generate() - end of the prefill forward): the decode forwards plus
                 generate()'s per-token work (logits processors, argmax, stopping criteria), as a user sees it.
Figures are medians over the timed rounds, which start once ascend_dsa's background glue compiles have landed
(glue_wait_s). first_generate_s is the first (cold) generate() of a fresh model, compiles included; graphs is
the number of graphs Dynamo handed the backend in it (graph breaks and recompiles, e.g. static then dynamic
decode shapes), recompiles those compiled in every later call (expected 0). tokens_equal: every generate() of
the backend gave eager's first-call tokens (first_diff_token: the index of the first new token that differed).
`--busy` keeps one core busy in a separate process while measuring.
"""
from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any, TextIO

import torch
from torch._dynamo.utils import counters

import npu_graph
from npu_graph.kernels.native import dispatch
from npu_graph.observe import progress
from npu_graph.observe.report import glue_summary
from npu_graph.runtime import glue_upgrade
from npu_graph.tools.bench_generate_cases import Case, cases
from npu_graph.tools.bench_generate_cold import measure_cold
from npu_graph.tools.timing import time_side_by_side

BACKENDS = ("eager", "inductor", "ascend_dsa")
@contextlib.contextmanager
def busy_core(enabled: bool = True) -> Iterator[subprocess.Popen | None]:
    """A separate Python process spinning on one core while the block runs; stopped at the end, also on error."""
    if not enabled:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Recorder:
    """Stands in for `model.forward`: calls `fn`, noting each call's (start, end) and the graphs Dynamo compiled."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.calls: list[tuple[float, float]] = []
        self.graphs = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        before = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.calls.append((start, time.perf_counter()))
            self.graphs += counters["stats"]["unique_graphs"] - before


def own_frame(forward: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """A function calling `forward` with a code object of its own, so each backend's Dynamo guards stay its own
    (see bench_e2e._own_frame). `tag` names its file: Dynamo keys automatic-dynamic shape decisions by (file,
    line, name), so frames exec'd from one "<string>" would share them, and a backend compiled after another
    would start from shapes the earlier one found dynamic (fewer graphs, a shorter cold call)."""
    namespace: dict[str, Any] = {}
    code = compile("def forward(*args, **kwargs):\n    return inner(*args, **kwargs)\n", f"<{tag}>", "exec")
    exec(code, {"inner": forward}, namespace)
    return namespace["forward"]


@dataclass
class Runner:
    """One backend's model copy and what its generate() calls measured."""
    model: torch.nn.Module
    recorder: Recorder
    prompt: torch.Tensor
    new_tokens: int
    samples: list[tuple[float, float, float]] = field(default_factory=list)   # (prefill_s, decode_s, total_s)
    outputs: list[torch.Tensor] = field(default_factory=list)

    def generate(self) -> torch.Tensor:
        self.recorder.calls.clear()
        start = time.perf_counter()
        out = self.model.generate(self.prompt, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                                  do_sample=False)
        end = time.perf_counter()
        first_start, first_end = self.recorder.calls[0]
        self.samples.append((first_end - first_start, end - first_end, end - start))
        self.outputs.append(out[0, self.prompt.shape[1]:])
        return out


def make_runners(case: Case, backends: Sequence[str]) -> tuple[dict[str, Runner], npu_graph.Backend]:
    """A fresh model per backend (same seed, same weights); compiled ones get their own forward frame."""
    ours = npu_graph.Backend(npu_graph.CompilerConfig.from_options({"cache": False}))
    prompt = case.prompt()
    runners = {}
    for name in backends:
        model = case.build()
        forward = model.forward
        if name != "eager":
            frame = own_frame(forward, f"bench generate {case.label} {name}")
            forward = torch.compile(frame, backend=ours if name == "ascend_dsa" else name)
        recorder = Recorder(forward)
        model.forward = recorder
        runners[name] = Runner(model, recorder, prompt, case.new_tokens)
    return runners, ours


def measure_generate(case: Case, backends: Sequence[str] = BACKENDS, repeat: int = 3,
                     busy: bool = False) -> list[dict[str, Any]]:
    """Cold generate() per backend, one warm-up each, then `repeat` rounds alternating backends (rounded up to
    whole cycles of tools.timing's orders); one row per backend. `backends` must include eager."""
    torch._dynamo.reset()
    runners, ours = make_runners(case, backends)
    first_s, graphs = {}, {}
    with torch.no_grad():
        for name, runner in runners.items():
            start = time.perf_counter()
            runner.generate()
            first_s[name] = time.perf_counter() - start
            graphs[name] = runner.recorder.graphs
        for runner in runners.values():
            runner.generate()
            runner.samples.clear()
        start = time.perf_counter()     # ascend_dsa's glue compiles still running in the background, if any
        glue_upgrade.wait_all()
        glue_wait_s = time.perf_counter() - start
        dispatch.take_used()
        time_side_by_side({name: runner.generate for name, runner in runners.items()}, repeat=repeat, warmup=0)
        impl = dispatch.take_used()
    figures = {name: _figures(runner, case.new_tokens) for name, runner in runners.items()}
    reference = runners["eager"].outputs[0]
    return [_row(case, name, runners[name], figures, reference, first_s[name], graphs[name], busy,
                 {"impl": impl, "fallback_graphs": sum(1 for r in ours.reports if r.fallback),
                  "glue": glue_summary(ours.reports), "glue_wait_s": glue_wait_s}
                 if name == "ascend_dsa" else {})
            for name in runners]


def _figures(runner: Runner, new_tokens: int) -> dict[str, float]:
    prefill, decode, total = (median(s[i] for s in runner.samples) for i in range(3))
    return {"prefill_ms": prefill * 1e3, "decode_tok_s": (new_tokens - 1) / decode if decode > 0 else float("nan"),
            "generate_ms": total * 1e3}


def _first_diff(outputs: list[torch.Tensor], reference: torch.Tensor) -> int | None:
    for out in outputs:
        if not torch.equal(out, reference):
            if out.shape != reference.shape:
                return min(out.shape[0], reference.shape[0])
            return int((out != reference).nonzero()[0, 0])
    return None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _row(case: Case, name: str, runner: Runner, figures: dict[str, dict[str, float]], reference: torch.Tensor,
         first_s: float, graphs: int, busy: bool, extra: dict[str, Any]) -> dict[str, Any]:
    mine, eager, inductor = figures[name], figures["eager"], figures.get("inductor", {})
    diff = _first_diff(runner.outputs, reference)
    compiled = name != "eager"
    return {"case": case.label, "backend": name, "prompt": case.prompt_len, "new_tokens": case.new_tokens,
            "busy": busy, **mine, "first_generate_s": first_s,
            "graphs": graphs if compiled else None,
            "recompiles": runner.recorder.graphs - graphs if compiled else None,
            "tokens_equal": diff is None, "first_diff_token": diff,
            "prefill_speedup_vs_eager": _ratio(eager["prefill_ms"], mine["prefill_ms"]),
            "prefill_speedup_vs_inductor": _ratio(inductor.get("prefill_ms"), mine["prefill_ms"]),
            "decode_speedup_vs_eager": _ratio(mine["decode_tok_s"], eager["decode_tok_s"]),
            "decode_speedup_vs_inductor": _ratio(mine["decode_tok_s"], inductor.get("decode_tok_s")),
            "fallback_graphs": None, "impl": None, "glue": None, "glue_wait_s": None, **extra}


def _ratio_notes(rows: list[dict[str, Any]]) -> list[str]:
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"x{value:.2f}"

    return [f"{r['case']}: ascend_dsa prefill {fmt(r['prefill_speedup_vs_inductor'])} vs inductor, "
            f"{fmt(r['prefill_speedup_vs_eager'])} vs eager; decode tok/s {fmt(r['decode_speedup_vs_inductor'])} "
            f"vs inductor, {fmt(r['decode_speedup_vs_eager'])} vs eager"
            for r in rows if r["backend"] == "ascend_dsa"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    repeat = args.repeat or (2 if args.quick else 5)
    busy = bool(getattr(args, "busy", False))
    rows: list[dict[str, Any]] = []
    with busy_core(busy):
        for case in cases(args.quick):
            with progress.step(f"{case.label}: generate() in {', '.join(BACKENDS)}", "bench generate"):
                rows += measure_generate(case, BACKENDS, repeat, busy)
    torch._dynamo.reset()
    extra = {"cold": cold_rows(cases(args.quick))} if getattr(args, "cold", False) else {}
    return {"suite": "generate", "busy": busy, "rows": rows, **extra,
            "notes": ["prefill_ms: the first forward of generate(); decode_tok_s: (new_tokens - 1) / (generate() end "
                      "- prefill end); medians of rounds alternating backends; speedups > 1: this backend faster",
                      "first_generate_s: cold generate() of a fresh model, compiles included (Inductor's on-disk "
                      "FX graph cache may be warm from earlier runs; ascend_dsa's cache is off)",
                      "recompiles: graphs compiled after the first generate() (expected 0)",
                      "glue_wait_s: after the first and a warm-up generate() of each backend, how long the bench "
                      "waited for ascend_dsa's background glue compiles (npu_graph.runtime.glue_upgrade) before the "
                      "timed rounds; the graphs ran their Python glue until then",
                      *_ratio_notes(rows)]}


def cold_rows(to_measure: list[Case]) -> list[dict[str, Any]]:
    """--cold: first generate() with empty compile caches and again warm, each in processes of its own
    (npu_graph.tools.bench_generate_cold)."""
    rows = []
    for case in to_measure:
        with progress.step(f"{case.label}: cold and warm first generate() in fresh processes", "bench generate"):
            rows += measure_cold(case)
    return rows


# (row key, header, width, format): "<" left-aligned text, "x" a speedup, else a format spec or str().
COLUMNS = (("case", "case", 18, "<"), ("backend", "backend", 10, "<"), ("prefill_ms", "prefill_ms", 10, ".1f"),
           ("decode_tok_s", "decode_tok/s", 12, ".1f"), ("generate_ms", "generate_ms", 11, ".0f"),
           ("first_generate_s", "first_gen_s", 11, ".1f"), ("glue_wait_s", "glue_wait_s", 11, ".1f"),
           ("graphs", "graphs", 6, ""),
           ("recompiles", "recompiles", 10, ""), ("tokens_equal", "tokens_eq", 9, ""),
           ("prefill_speedup_vs_eager", "prefill/eag", 11, "x"),
           ("prefill_speedup_vs_inductor", "prefill/ind", 11, "x"),
           ("decode_speedup_vs_eager", "decode/eag", 10, "x"),
           ("decode_speedup_vs_inductor", "decode/ind", 10, "x"),
           ("busy", "busy", 5, ""), ("impl", "impl", 0, "<"))


def print_text(result: dict[str, Any], out: TextIO | None = None) -> None:
    """One line per model and backend (bench's rich table would wrap this many columns), then the notes."""
    out = out or sys.stdout
    machine = result.get("machine", {})
    print(f"ascend-dsa bench generate — {machine.get('cpu', '?')}, native kernels at {result.get('isa', '?')} "
          f"({machine.get('native_mode', '?')}), busy core: {result.get('busy')}", file=out)
    print(" ".join(_pad(header, width, fmt) for _, header, width, fmt in COLUMNS), file=out)
    for row in result["rows"]:
        print(" ".join(_pad(_cell(row.get(key), fmt), width, fmt) for key, _, width, fmt in COLUMNS), file=out)
    for row in result.get("cold", []):
        print(f"{row['case']} {row['backend']}: first generate() {row['cold_first_generate_s']:.1f} s with empty "
              f"caches ({_cell(row['cold_vs_inductor_cold'], 'x')} Inductor's), {row['warm_first_generate_s']:.1f} s "
              f"warm ({_cell(row['warm_vs_own_cold'], 'x')} its cold)"
              + (f", glue landed {row['glue_ready_s']:.1f} s after it" if row.get("glue_ready_s") is not None else ""),
              file=out)
    for note in result.get("notes", []):
        print(f"- {note}", file=out)


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "x":
        return f"x{value:.2f}"
    return format(value, fmt) if fmt not in ("", "<") and isinstance(value, float) else str(value)


def _pad(text: str, width: int, fmt: str) -> str:
    return text.ljust(width) if fmt == "<" else text.rjust(width)

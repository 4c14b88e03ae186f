"""`ascend-dsa bench context`: the cost of one DeepSeek-V3.2-sized layer (tools/context_rig.py) as the context grows,
for dense MLA and DSA in eager, Inductor and ascend_dsa (bf16 and the FP8 policy), against the roofline floor.

Decode points: one new token after 4K..128K cached ones (`--quick`: 4K, 32K, 128K); at each context every row
is timed side by side (tools.timing); then ascend_dsa's verify steps of 2, 3 and 4 tokens (`ascend_dsa_verify<N>`,
the step's ms) side by side with its one-token step (`vs_one_token`). Each point carries its roofline floor
(tools/context_costs.py, with the rates tools/roofline.py measures in the same run): `floor_ms` of the whole
step, `op_floor_sum_ms` of its operations one after another, and `ratio_to_floor`.

Prefill points ("phase": "prefill", tools/context_prefill.py): every row prefilling 4K, 8K and 16K tokens
(`--quick`: 4K) in chunks of 1K, with the process's peak memory during each prefill. KDA points (rows `kda` and
`kda_cp2`, tools/context_kda.py): the KDA core of a Kimi Linear layer prefilling 16K..1M tokens (`--quick`: 128K)
in one process and split over two ranks, each its own process.
"""
from __future__ import annotations

import argparse
import resource
import time
from typing import Any

import torch

from npu_graph.models.context_layer import REAL_SIZES, bf16_context_layer, real_size_config, weights_bytes
from npu_graph.observe import progress
from npu_graph.runtime import glue_upgrade
from npu_graph.tools import context_costs, context_kda, context_memory, context_prefill, context_rig, roofline
from npu_graph.tools.context_plot import write_plot  # noqa: F401  (`--plot`: tools.bench calls it)
from npu_graph.tools.timing import time_side_by_side

CONTEXTS = {False: (4096, 8192, 16384, 32768, 65536, 131072), True: (4096, 32768, 131072)}
VERIFY_TOKENS = (2, 3, 4)
DECODE_ROUNDS = {False: 6, True: 3}
PREFILL_ROUNDS = {False: 2, True: 1}
PREFILL_BUDGET_S = {False: 1800.0, True: 120.0}   # a baseline row's projected prefill past this is not run
SLOW_STEP_S = 10.0    # a row's step this long is timed once (tools.timing: slow_s)
# Small sizes for tests (`--toy`, hidden): every code path of the real sweep, in a few minutes with every row compiled.
TOY_SIZES = {"hidden_size": 256, "num_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 128, "qk_nope_head_dim": 32,
             "qk_rope_head_dim": 16, "v_head_dim": 32, "index_n_heads": 8, "index_head_dim": 32,
             "index_rope_head_dim": 16, "index_topk": 64, "intermediate_size": 128, "block_size": 16}
TOY_CONTEXTS = (128, 512)


class Sweep:
    """The layer, its rows' step functions and the machine's rates, shared by every point."""

    def __init__(self, toy: bool, rows: tuple[str, ...] | None = None) -> None:
        torch.manual_seed(0)
        self.config = real_size_config(max(TOY_CONTEXTS), **TOY_SIZES) if toy else real_size_config(4096)
        self.layer = bf16_context_layer(self.config)
        self.steps = context_rig.row_steps(self.layer, rows)
        self.rates, self.rate_figures = roofline.measure(small=toy)
        self.weight_params = sum(p.numel() for p in self.layer.parameters() if p.dim() > 1)
        self.index_params = sum(p.numel() for p in self.layer.attn.indexer.parameters() if p.dim() > 1)

    def work(self, context: int, tokens: int, row: str) -> dict[str, context_costs.Work]:
        return context_costs.step_work(self.config, self.weight_params, self.index_params, context, tokens,
                                       context_rig.is_sparse(row), row in context_rig.FP8_ROWS)


def point(sweep: Sweep, phase: str, row: str, context: int, seconds: float, tokens: int,
          caches: dict[bool, Any]) -> dict[str, Any]:
    """One point of the JSON: time, floor and cache bytes of `row` at `context`."""
    work = sweep.work(context, tokens, row)
    floor_s, op_sum_s = context_costs.floors(work, sweep.rates)
    return {"phase": phase, "row": row, "context": context, "tokens": tokens, "ms": 1e3 * seconds,
            "floor_ms": 1e3 * floor_s, "op_floor_sum_ms": 1e3 * op_sum_s, "ratio_to_floor": seconds / floor_s,
            "cache_bytes": context_rig.held_bytes(caches[row in context_rig.FP8_ROWS]),
            "cache_bytes_read": context_costs.cache_bytes_read(work), "topk_overlap": None}


@torch.no_grad()
def decode_points(sweep: Sweep, context: int, rounds: int) -> list[dict[str, Any]]:
    """Every row's decode step and ascend_dsa's verify steps at `context`, timed side by side."""
    caches = context_rig.new_caches(sweep.config, context + max(VERIFY_TOKENS), context)
    generator = torch.Generator().manual_seed(context)
    inputs = {n: torch.randn(1, n, sweep.config.hidden_size, generator=generator).bfloat16()
              for n in (1, *VERIFY_TOKENS)}

    def call(row: str, tokens: int) -> Any:
        step, cache = sweep.steps[row], caches[row in context_rig.FP8_ROWS]

        def run() -> torch.Tensor:
            cache.lengths.fill_(context)
            return step(inputs[tokens], cache)
        return run

    verify = VERIFY_TOKENS if "ascend_dsa" in sweep.steps else ()
    rows = {row: call(row, 1) for row in sweep.steps}
    steps = {"ascend_dsa": rows.get("ascend_dsa"), **{f"ascend_dsa_verify{n}": call("ascend_dsa", n) for n in verify}}
    for run in [*rows.values(), *list(steps.values())[1:]]:      # compiles (a new context may recompile)
        run()
    glue_upgrade.wait_all()
    # Two groups, each timed side by side: a balanced order of n candidates takes n (even) or 2n (odd) rounds.
    medians = time_side_by_side(rows, repeat=rounds, warmup=1, slow_s=SLOW_STEP_S)
    points = [point(sweep, "decode", row, context, medians[row], 1, caches) for row in sweep.steps]
    overlaps = context_rig.topk_overlaps(sweep.layer, inputs[1], caches, context)
    for p in points:
        if p["row"] in context_rig.FP8_ROWS:
            p.update(overlaps)
    if verify:
        medians = time_side_by_side(steps, repeat=rounds, warmup=1)
    for n in verify:
        step = point(sweep, "decode", "ascend_dsa", context, medians[f"ascend_dsa_verify{n}"], n, caches)
        points.append({**step, "row": f"ascend_dsa_verify{n}",
                       "vs_one_token": medians[f"ascend_dsa_verify{n}"] / medians["ascend_dsa"]})
    return points


def run(args: argparse.Namespace) -> dict[str, Any]:
    toy = getattr(args, "toy", False)
    torch._dynamo.reset()
    contexts = TOY_CONTEXTS if toy else CONTEXTS[bool(args.quick)]
    contexts = _chosen(getattr(args, "contexts", None), contexts, int)
    rows = _chosen(getattr(args, "rows", None), context_rig.ROWS, str)
    rounds = args.repeat or DECODE_ROUNDS[bool(args.quick)]
    start = time.perf_counter()
    with progress.step("layer, rows and the machine's rates", "bench context"):
        sweep = Sweep(toy, rows)
    points = []
    prefills = context_prefill.TOY_CONTEXTS if toy else context_prefill.CONTEXTS[bool(args.quick)]
    chunk = context_prefill.TOY_CHUNK if toy else context_prefill.CHUNK
    with progress.Sweep(len(contexts) + len(prefills) + 1, "bench context") as bar:
        for context in contexts:
            with bar.point(f"decode @ {context}"):
                points += decode_points(sweep, context, rounds)
        for tokens in prefills:
            with bar.point(f"prefill of {tokens} in chunks of {chunk}"):
                points += context_prefill.prefill_points(sweep, tokens, chunk, PREFILL_ROUNDS[bool(args.quick)],
                                                         PREFILL_BUDGET_S[bool(args.quick)])
        with bar.point("KDA prefill, one process and two ranks"):
            kda, skipped = context_kda.kda_points(sweep.rates, bool(args.quick), toy)
    points += kda
    at_largest = [p for p in points if p["phase"] == "decode" and p["context"] == max(contexts) and p["tokens"] == 1]
    held = {p["row"] in context_rig.FP8_ROWS: p["cache_bytes"] for p in at_largest}
    with progress.step(f"memory of the ascend_dsa rows at {max(contexts)}", "bench context"):
        memory = context_memory.measure_in_new_process(max(contexts), TOY_SIZES if toy else {})
    result = {"suite": "context", "points": points,
              "peak_rss_bytes": memory["peak_rss_bytes"], "memory": memory,
              "sweep_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "weights_bytes": weights_bytes(sweep.layer),
              "cache_bytes_held": sum(held.values()),      # the bf16 and FP8 caches, both held at once
              "rates": sweep.rate_figures, "sizes": TOY_SIZES if toy else REAL_SIZES,
              "seconds": time.perf_counter() - start}
    result["notes"] = notes(result) + skipped
    return result


def _chosen(given: str | None, default: tuple, kind: type) -> tuple:
    """The comma-separated `given` values (`--rows`, `--contexts`), each checked against what the sweep knows
    (rows) or read as a number of tokens (contexts); `default` when not given."""
    if given is None:
        return default
    try:
        chosen = tuple(kind(v) for v in given.split(",") if v.strip())
    except ValueError:
        raise SystemExit(f"ascend-dsa bench context: --contexts takes token counts such as 4096,32768, "
                         f"not {given!r}") from None
    if kind is str and (not chosen or any(v not in default for v in chosen)):
        raise SystemExit(f"ascend-dsa bench context: --rows {given!r} names a row it does not know; rows: "
                         f"{', '.join(default)}")
    if kind is int and (not chosen or min(chosen) < 1):
        raise SystemExit(f"ascend-dsa bench context: --contexts {given!r} gives no positive token count")
    return chosen


def notes(result: dict[str, Any]) -> list[str]:
    rates = result["rates"]
    return [f"roofline: read {rates['read_bytes_per_s'] / 1e9:.1f} GB/s, GEMM "
            f"{max(v for k, v in rates.items() if k.startswith('gemm')) / 1e9:.0f} GFLOP/s (measured in this run)",
            "ms: median of rounds alternating every row of a context (tools.timing; a row whose step takes over "
            f"{SLOW_STEP_S:.0f} s is timed once); verify<N>: ms of the N-token step, vs_one_token: against "
            "ascend_dsa's one-token step timed in the same rounds",
            "peak_rss_bytes: the peak resident set above the runtime's own of a process decoding with the ascend_dsa "
            "rows at the largest context (tools/context_memory.py); sweep_peak_rss_bytes: this process's peak over the "
            "whole sweep (every row's compiled graphs and working buffers)",
            "prefill: chunks of 1K tokens into an empty cache, ms the median over rounds alternating the rows; "
            "peak_bytes: resident memory high-water mark (VmHWM) during the prefill above the memory before it; "
            "an eager or Inductor row whose prefill flops at the bf16 GEMM rate measured here would take past "
            f"{PREFILL_BUDGET_S[True]:.0f} s (--quick; {PREFILL_BUDGET_S[False]:.0f} s otherwise) is not run: its "
            "point has ms null and says why under `skipped`",
            "kda / kda_cp2: the KDA core (32 heads x 128) in fresh processes, 2K tokens per chunk_kda call; "
            "peak_bytes per process: VmHWM above its memory before its inputs were made; kda_cp2 runs two passes "
            "(the slice's transition, then its outputs from the folded state), one thread per rank; model_ms: time "
            "to first token for N ranks from the measured parts"]


def _table(result: dict[str, Any], title: str, columns: tuple[str, ...], rows: list[list[str]]) -> Any:
    from rich.table import Table

    machine = result.get("machine", {})
    table = Table(title=f"ascend-dsa bench context, {title} — {machine.get('cpu', '?')}, "
                        f"{machine.get('threads', '?')} threads, native kernels at {result.get('isa', '?')}")
    for column in columns:
        table.add_column(column, justify="left" if column in ("phase", "row") else "right")
    for row in rows:
        table.add_row(*row)
    return table


def _mib(value: float | None) -> str:
    return "" if value is None else f"{value / 2**20:.0f}"


def _decode_rows(points: list[dict[str, Any]]) -> list[list[str]]:
    return [[p["row"], str(p["context"]), f"{p['ms']:.1f}", f"{p['floor_ms']:.1f}", f"{p['ratio_to_floor']:.2f}",
             f"{p['op_floor_sum_ms']:.1f}", _mib(p["cache_bytes"]), f"{p['cache_bytes_read'] / 2**20:.1f}",
             "" if p["topk_overlap"] is None else f"{p['topk_overlap']:.3f}"] for p in points]


def _prefill_rows(points: list[dict[str, Any]]) -> list[list[str]]:
    return [[p["row"], str(p["context"]), "not run" if p["ms"] is None else f"{p['ms']:.0f}", f"{p['floor_ms']:.0f}",
             "" if p["ratio_to_floor"] is None else f"{p['ratio_to_floor']:.2f}",
             f"{p['op_floor_sum_ms']:.0f}", _mib(p["cache_bytes"]), _mib(p["peak_bytes"])] for p in points]


def _kda_rows(points: list[dict[str, Any]]) -> list[list[str]]:
    return [[p["row"], str(p["context"]), f"{p['ms']:.0f}", f"{p['floor_ms']:.0f}", f"{p['ratio_to_floor']:.2f}",
             _mib(p["peak_bytes"]), f"{p['peak_ratio']:.2f}" if "peak_ratio" in p else "",
             f"{p['rel_diff']:.1e}" if "rel_diff" in p else "",
             " ".join(f"{n}:{ms:.0f}" for n, ms in p.get("model_ms", {}).items())] for p in points]


def print_text(result: dict[str, Any]) -> None:
    from rich.console import Console

    points = result["points"]
    decode = [p for p in points if p["phase"] == "decode"]
    prefill = [p for p in points if p["phase"] == "prefill" and not p["row"].startswith("kda")]
    kda = [p for p in points if p["row"].startswith("kda")]
    console = Console()
    console.print(_table(result, "decode", ("row", "context", "ms", "floor_ms", "ratio", "op floors", "cache MiB",
                                            "read MiB", "overlap"), _decode_rows(decode)))
    console.print(_table(result, "chunked prefill", ("row", "tokens", "ms", "floor_ms", "ratio", "op floors",
                                                     "cache MiB", "peak MiB"), _prefill_rows(prefill)))
    console.print(_table(result, "KDA prefill", ("row", "tokens", "ms", "floor_ms", "ratio", "peak MiB / rank",
                                                 "peak ratio", "rel_diff", "model ms by ranks"), _kda_rows(kda)))
    console.print(f"weights {result['weights_bytes'] / 2**20:.0f} MiB, caches held at the largest context "
                  f"{result['cache_bytes_held'] / 2**20:.0f} MiB, peak RSS of the ascend_dsa rows above the runtime's "
                  f"{result['peak_rss_bytes'] / 2**20:.0f} MiB "
                  f"(whole sweep {result['sweep_peak_rss_bytes'] / 2**20:.0f} MiB)")
    for note in result["notes"]:
        console.print(f"- {note}")

"""`ascend-dsa bench fusion`: for every fusion family, spellings drawn from its independent choices
(npu_graph.tools.fusion_spellings), each compiled static and with dynamic=True: how many fused (both compiles show
the family's fused ops) and how many were exact (both match eager); and for the indexer and rotary families, a
fused spelling beside Inductor at S=2048, timed side by side (tools/timing.py). JSON:
{"families": [{"family", "drawn", "fused", "exact"}, ...], "timings": [...]}."""
from __future__ import annotations

import argparse
from typing import Any

import torch

from npu_graph.observe import progress
from npu_graph.tools.fusion_check import OPTIONS, compile_spelling
from npu_graph.tools.fusion_spellings import families, indexer, rotary
from npu_graph.tools.timing import time_side_by_side

SPELLINGS = 12
SEED = 0
TIMED_LENGTH = 2048


def family_row(fam: Any, count: int, seed: int) -> dict[str, Any]:
    """Draw `count` spellings; each counts as fused (exact) when its static and dynamic compiles both are."""
    drawn = fused = exact = 0
    misses: list[str] = []
    for choice in fam.draw(count, seed):
        outcomes = [compile_spelling(fam.build(choice), dynamic) for dynamic in (False, True)]
        drawn += 1
        fused += all(o.fused for o in outcomes)
        exact += all(o.exact for o in outcomes)
        misses += [f"{fam.name} {choice}: {o.detail}" for o in outcomes if not (o.fused and o.exact)][:1]
    return {"family": fam.name, "drawn": drawn, "fused": fused, "exact": exact, "space": len(fam.spellings()),
            "misses": misses}


def _timed(name: str, module: torch.nn.Module, inputs: tuple, fused_op: str, repeat: int) -> dict[str, Any]:
    """ascend_dsa (its fused op checked) beside Inductor and eager on one spelling."""
    torch._dynamo.reset()
    ours = torch.compile(module, backend="ascend_dsa", options={**OPTIONS, "cpu_glue": "auto"})
    inductor = torch.compile(module, backend="inductor")
    with torch.no_grad():
        ours(*inputs), inductor(*inputs)
        medians = time_side_by_side({"ascend_dsa": lambda: ours(*inputs), "inductor": lambda: inductor(*inputs),
                                     "eager": lambda: module(*inputs)}, repeat=repeat)
    return {"case": name, "fused_op": fused_op, "ascend_dsa_ms": medians["ascend_dsa"] * 1e3,
            "inductor_ms": medians["inductor"] * 1e3, "eager_ms": medians["eager"] * 1e3,
            "speedup_vs_inductor": medians["inductor"] / medians["ascend_dsa"]}


def timing_rows(length: int, repeat: int) -> list[dict[str, Any]]:
    """The indexer (16 heads × 64, top-256) and rotary (16 heads × 64) at `length` tokens."""
    index = indexer.Indexer(indexer.PLAIN, sizes=(16, 64, 256, 128))
    rope = rotary.Rotary({"form": "pairs", "layout": "halves", "take": "chunk", "order": "x_first",
                          "sum_order": "cos_first", "angles": "widen_cos", "broadcast": "unsqueeze"},
                         sizes=(16, 64, 128))
    rows = []
    with progress.step(f"indexer at S={length}", "bench fusion"):
        rows.append(_timed(f"indexer S={length} (16×64, top-256)", index,
                           indexer.inputs(length, length, 128, 1), "lightning_indexer", repeat))
    with progress.step(f"rotary at S={length}", "bench fusion"):
        rows.append(_timed(f"rotary S={length} (16×64)", rope, rotary.inputs(length, 128, 1), "rotary_mul", repeat))
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    count = getattr(args, "spellings", None) or SPELLINGS
    rows = []
    for fam in families():
        with progress.step(f"{fam.name}: {count} spellings, static and dynamic", "bench fusion"):
            rows.append(family_row(fam, count, SEED))
    repeat = args.repeat or (5 if args.quick else 15)
    timings = timing_rows(512 if args.quick else TIMED_LENGTH, repeat)
    notes = [f"a spelling counts as fused (exact) when its static and its dynamic=True compile both are; "
             f"{count} drawn per family with seed {SEED}"] + [m for r in rows for m in r["misses"]]
    table = [{k: v for k, v in r.items() if k != "misses"} for r in rows] + timings
    return {"suite": "fusion", "families": [{k: r[k] for k in ("family", "drawn", "fused", "exact")} for r in rows],
            "timings": timings, "rows": table, "notes": notes}


def print_text(result: dict[str, Any]) -> None:
    """One line per family, one per timed case (a table of both would not fit a terminal)."""
    machine = result.get("machine", {})
    print(f"ascend-dsa bench fusion — {machine.get('cpu', '?')}, native kernels at {result.get('isa', '?')}")
    print(f"{'family':<18}{'drawn':>6}{'fused':>6}{'exact':>6}{'spellings':>11}")
    for row in (r for r in result["rows"] if "family" in r):
        print(f"{row['family']:<18}{row['drawn']:>6}{row['fused']:>6}{row['exact']:>6}{row['space']:>11}")
    for t in result["timings"]:
        print(f"{t['case']}: {t['fused_op']} {t['ascend_dsa_ms']:.3g} ms, Inductor {t['inductor_ms']:.3g} ms, "
              f"eager {t['eager_ms']:.3g} ms: {t['speedup_vs_inductor']:.2f}× Inductor's speed")
    for note in result.get("notes", []):
        print(f"- {note}")

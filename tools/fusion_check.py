"""Compiling one spelling of a fusion family and judging it: did it compile to the family's fused ops, and does
it give eager's numbers (the family's rule, fusion_spellings/compare.py)? Shared by the spelling tests and
`ascend-dsa bench fusion`."""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

import npu_graph
from npu_graph.tools.fusion_spellings import Spelling

OPTIONS = {"cache": False, "cpu_glue": "python"}


@dataclass
class Outcome:
    fused: bool
    exact: bool
    detail: str
    fused_ops: dict[str, int] = field(default_factory=dict)
    near_misses: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


def _fused_ops(reports: list[Any]) -> dict[str, int]:
    total: dict[str, int] = {}
    for report in reports:
        for op, count in report.fused_ops.items():
            total[op] = total.get(op, 0) + count
    return total


def compile_spelling(spelling: Spelling, dynamic: bool, options: dict[str, Any] | None = None) -> Outcome:
    """torch.compile(spelling.module, backend="ascend_dsa", options={"cache": False, ...}, dynamic=dynamic), run
    once beside eager; the fused-op counts it must show and the family's comparison decide."""
    torch._dynamo.reset()
    options = {**OPTIONS, **(options or {})}
    backend = npu_graph.get_backend(options)
    first = len(backend.reports)
    start = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref = spelling.module(*spelling.inputs)
        out = torch.compile(spelling.module, backend="ascend_dsa", options=options, dynamic=dynamic)(
            *spelling.inputs)
    seconds = time.perf_counter() - start
    reports = backend.reports[first:]
    ops = _fused_ops(reports)
    fused = all(ops.get(op, 0) == count for op, count in spelling.fused.items())
    difference = spelling.check(out, ref, spelling.inputs)
    fallbacks = [str(w.message) for w in caught if "ascend_dsa" in str(w.message)]
    near = [m for r in reports for m in r.near_misses()]
    detail = "; ".join(filter(None, [
        None if fused else f"fused ops {ops}, expected {spelling.fused}", difference, *fallbacks[:2],
        *(f"near miss: {m.get('reason')}" for m in near[:2])]))
    return Outcome(fused, difference is None, detail, ops, near, seconds)

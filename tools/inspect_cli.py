"""`ascend-dsa inspect`: read a graph dump from the command line.

    ascend-dsa inspect DUMP                        table of graphs
    ascend-dsa inspect DUMP --graph G              the stages of one graph
    ascend-dsa inspect DUMP --graph G --pass P     the text of one stage
    ascend-dsa inspect diff DUMP A B [--graph G]   what changed between stages A and B
    ascend-dsa inspect html DUMP -o report.html    one self-contained HTML report

`--json` on every form prints only JSON on stdout. A missing dump, graph or stage exits with code 2 and a
message naming what exists.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from npu_graph.tools import inspect_dump
from npu_graph.tools.inspect_dump import DumpError

USAGE = """ascend-dsa inspect DUMP [--graph G] [--pass P] [--json]
       ascend-dsa inspect diff DUMP A B [--graph G] [--json]
       ascend-dsa inspect html DUMP [-o report.html] [--json]"""
ROW_LIMIT = 50


def add_parser(sub: Any) -> None:
    """Register the `inspect` subcommand on the `ascend-dsa` subparsers."""
    p = sub.add_parser("inspect", help="read a graph dump: graphs, stages, diffs, HTML report", usage=USAGE,
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("words", nargs="+", metavar="DUMP | diff DUMP A B | html DUMP")
    p.add_argument("--graph", default=None, help="graph: folder name, graph name or index")
    p.add_argument("--pass", dest="stage", default=None, help="stage: pass name, number or 'captured'")
    p.add_argument("-o", "--output", default=None, help="HTML report path (default: DUMP/report.html)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _cell(value: Any) -> Text:
    return Text("-" if value is None or value == "" else str(value))


def _table(title: str, columns: list[str], rows: list[list[Any]], total: int | None = None) -> Table:
    shown = len(rows) if total is None else total
    more = f" (first {len(rows)} of {shown}; --json for all)" if shown > len(rows) else ""
    table = Table(title=title + more)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(_cell(v) for v in row))
    return table


def _print_overview(console: Console, data: dict[str, Any]) -> None:
    rows = []
    for g in data["graphs"]:
        fused = ", ".join(f"{op}×{n}" for op, n in g["fused_ops"].items()) or "-"
        cache = f"{g['cache']} ({g['cache_reason']})" if g["cache_reason"] else g["cache"]
        ms = f"{g['compile_ms']:.0f}" if isinstance(g["compile_ms"], (int, float)) else "-"
        streams = g["streams"] if g["streams"] is not None else "not planned"
        status = f"fallback: {g['fallback']}" if g["fallback"] else ("ok" if g["complete"] else "incomplete")
        rows.append([g["index"], g["folder"], inspect_dump.node_counts(g), fused, streams,
                     cache, ms, status])
    console.print(_table(f"graphs in {data['dump']}", ["#", "graph folder", "nodes before → after",
                                                       "fused ops", "streams", "cache", "compile ms",
                                                       "status"], rows))


def _print_stages(console: Console, data: dict[str, Any]) -> None:
    rows = [[s["index"], s["name"], s["nodes"], s["changed"], s["ms"],
             ", ".join(f"{k}={v}" for k, v in s["stats"].items())] for s in data["stages"]]
    console.print(_table(f"stages of {data['folder']}", ["#", "stage", "nodes", "changed", "ms", "stats"], rows))


def _print_diff(console: Console, d: dict[str, Any]) -> None:
    console.print(Text(f"{d['folder']}: {d['from']} → {d['to']} (passes: {', '.join(d['passes']) or '-'}); "
                       f"nodes {d['nodes_before']} → {d['nodes_after']}, +{len(d['added'])} added, "
                       f"−{len(d['removed'])} removed, {len(d['rewired'])} rewired"))
    if d["fused_ops"]:
        console.print(_table("fused ops", ["op", "before", "after"],
                             [[op, c["before"], c["after"]] for op, c in d["fused_ops"].items()]))
    region_rows = [[r["pass"], n["name"], n["target"], "yes" if n["fused"] else ""]
                   for r in d["fused_regions"] for n in r["nodes"]]
    if region_rows:
        console.print(_table("nodes created by the passes (fused regions)", ["pass", "node", "op", "fused"],
                             region_rows[:ROW_LIMIT], len(region_rows)))
    for key in ("added", "removed", "rewired"):
        if d[key]:
            rows = [[n["name"], n["target"], n["created_by"]] for n in d[key][:ROW_LIMIT]]
            console.print(_table(f"{key} nodes", ["node", "target", "created by"], rows, len(d[key])))


def _emit(args: argparse.Namespace, data: dict[str, Any], printer: Any) -> None:
    if args.json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        printer(Console(width=None if sys.stdout.isatty() else 160), data)


def _dispatch(args: argparse.Namespace) -> int:
    words = args.words
    if words[0] == "diff" and len(words) == 4:
        _emit(args, inspect_dump.diff(words[1], words[2], words[3], args.graph), _print_diff)
    elif words[0] == "html" and len(words) == 2:
        from npu_graph.tools.html_report import write_html_report

        path = write_html_report(words[1], args.output or os.path.join(words[1], "report.html"))
        _emit(args, {"report": path, "bytes": os.path.getsize(path)},
              lambda console, d: console.print(Text(f"HTML report: {d['report']}")))
    elif len(words) == 1 and args.stage is not None:
        data = inspect_dump.show_stage(words[0], args.graph, args.stage)
        _emit(args, data, lambda console, d: sys.stdout.write(d["text"]))
    elif len(words) == 1 and args.graph is not None:
        _emit(args, inspect_dump.graph_stages(words[0], args.graph), _print_stages)
    elif len(words) == 1:
        _emit(args, inspect_dump.overview(words[0]), _print_overview)
    else:
        raise DumpError(f"cannot read arguments {' '.join(words)!r}; usage:\n{USAGE}")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    """Run `ascend-dsa inspect`; 2 when the dump, graph or stage does not exist."""
    try:
        return _dispatch(args)
    except DumpError as exc:
        print(f"ascend-dsa inspect: error: {exc}", file=sys.stderr)
        return 2

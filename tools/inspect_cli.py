"""`ascend-dsa inspect`: read a graph dump from the command line.

    ascend-dsa inspect show DUMP                        table of graphs (`inspect DUMP` is the same)
    ascend-dsa inspect show DUMP --graph G              the stages of one graph and its near misses (the
                                                        canonical expression at each and what differs)
    ascend-dsa inspect show DUMP --graph G --pass P     the text of one stage
    ascend-dsa inspect diff DUMP A B [--graph G]        what changed between stages A and B
    ascend-dsa inspect html DUMP [-o report.html]       one self-contained HTML report

`--json` on every form prints only JSON on stdout. A missing, unreadable or damaged dump, graph or stage exits
with code 2 and a one-line message naming what exists or what to do.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from npu_graph.tools import inspect_dump
from npu_graph.tools.inspect_dump import DumpError

VIEWS = ("show", "diff", "html")
ROW_LIMIT = 50
DAMAGED = (KeyError, TypeError, AttributeError, IndexError, ValueError)  # a dump file holding the wrong shape
log = logging.getLogger(__name__)


def add_parser(sub: Any) -> None:
    """Register `inspect {show,diff,html}` on the `ascend-dsa` subparsers."""
    p = sub.add_parser("inspect", help="read a graph dump: graphs, stages, diffs, HTML report",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    views = p.add_subparsers(dest="view", required=True, metavar="{show,diff,html}")
    show = views.add_parser("show", help="the graphs of a dump, the stages of one graph, or one stage's text",
                            description="The graphs of a dump; with --graph the stages of one graph; with "
                                        "--graph and --pass the text of one stage.")
    _common(show)
    show.add_argument("--pass", dest="stage", metavar="P", default=None, help="stage: pass name, number or 'captured'")
    diff = views.add_parser("diff", help="what changed between two stages of one graph",
                            description="Nodes added, removed and rewired, and fused regions, from stage A to B.")
    _common(diff)
    diff.add_argument("a", metavar="A", help="first stage: pass name, number or 'captured'")
    diff.add_argument("b", metavar="B", help="second stage")
    html = views.add_parser("html", help="write one self-contained HTML report of the dump",
                            description="Graph picture, stream timeline, per-pass diffs, quantization and "
                                        "layout tables, in one HTML file.")
    html.add_argument("dump", metavar="DUMP", help="dump folder (the dump_dir option) or one graph folder")
    html.add_argument("-o", "--output", default=None, help="HTML report path (default: DUMP/report.html)")
    html.add_argument("--json", action="store_true", help="print the result as JSON")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump", metavar="DUMP", help="dump folder (the dump_dir option) or one graph folder")
    parser.add_argument("--graph", default=None, help="graph: folder name, graph name or index")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def default_view(argv: list[str]) -> list[str]:
    """`inspect DUMP ...` (the short form) is `inspect show DUMP ...`."""
    if len(argv) > 1 and argv[0] == "inspect" and argv[1] not in (*VIEWS, "-h", "--help"):
        return ["inspect", "show", *argv[1:]]
    return list(argv)


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
             ", ".join(f"{k}={v}" for k, v in s["stats"].items() if k != "near_misses")] for s in data["stages"]]
    console.print(_table(f"stages of {data['folder']}", ["#", "stage", "nodes", "changed", "ms", "stats"], rows))
    _print_near_misses(console, data.get("near_misses", []))


def _print_near_misses(console: Console, misses: list[dict[str, Any]]) -> None:
    """Why a pattern almost matched: the reason, the canonical expression at the anchor and the first term that
    differs from the pattern."""
    for miss in misses[:ROW_LIMIT]:
        console.print(Text(f"near miss of {miss.get('pass', '?')} at {miss.get('node', '?')} "
                           f"({miss.get('pattern', '?')}): {miss.get('reason', '')}"))
        if miss.get("canonical"):
            console.print(Text(f"  canonical: {miss['canonical']}"))
        if miss.get("differs"):
            console.print(Text(f"  differs:   {miss['differs']}"))
    if len(misses) > ROW_LIMIT:
        console.print(Text(f"(first {ROW_LIMIT} of {len(misses)} near misses; --json for all)"))


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


def _show(args: argparse.Namespace) -> None:
    if args.stage is not None:
        data = inspect_dump.show_stage(args.dump, args.graph, args.stage)
        _emit(args, data, lambda console, d: sys.stdout.write(d["text"]))
    elif args.graph is not None:
        _emit(args, inspect_dump.graph_stages(args.dump, args.graph), _print_stages)
    else:
        _emit(args, inspect_dump.overview(args.dump), _print_overview)


def _html(args: argparse.Namespace) -> None:
    from npu_graph.tools.html_report import write_html_report

    inspect_dump.find_graphs(args.dump)  # a missing or empty dump is named before any work
    path = write_html_report(args.dump, args.output or os.path.join(args.dump, "report.html"))
    _emit(args, {"report": path, "bytes": os.path.getsize(path)},
          lambda console, d: console.print(Text(f"HTML report: {d['report']}")))


def _dispatch(args: argparse.Namespace) -> None:
    if args.view == "diff":
        _emit(args, inspect_dump.diff(args.dump, args.a, args.b, args.graph), _print_diff)
    elif args.view == "html":
        _html(args)
    else:
        _show(args)


def _problem(args: argparse.Namespace, exc: Exception) -> str:
    if isinstance(exc, DumpError):
        return str(exc)
    if isinstance(exc, OSError):
        where = exc.filename or args.dump
        return f"cannot read {where}: {exc.strerror or exc}; check the path and its permissions"
    log.debug("damaged dump %s", args.dump, exc_info=True)
    return (f"the dump at {args.dump} looks damaged ({type(exc).__name__}: {exc}); write it again by compiling "
            f"with options={{'dump_dir': ...}}")


def run_inspect(args: argparse.Namespace) -> int:
    """Run `ascend-dsa inspect`; 2 when the dump, graph or stage is missing, unreadable or damaged."""
    try:
        _dispatch(args)
    except (DumpError, OSError, *DAMAGED) as exc:
        print(f"ascend-dsa inspect: error: {_problem(args, exc)}", file=sys.stderr)
        return 2
    return 0

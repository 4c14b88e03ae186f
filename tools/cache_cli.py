"""`ascend-dsa cache {ls,show,stats,prune,clear,verify,export,import}`: manage the on-disk compile cache.

Every subcommand takes --json and --dir (default: ASCEND_DSA_CACHE_DIR, else ~/.cache/ascend_dsa). Only
`import` creates a cache; the others never create anything, and `ls`, `show`, `stats` and `export` change
nothing. Names in entries/ that are not entries are ignored (`verify` reports them, `clear` removes them).
`verify` and `clear` cover the shared Dynamo traces too (npu_graph.cache.traces; `verify` counts them as
"traces" where there are any).
Exit codes: 0 when all went well, 1 when the command met something wrong (a damaged entry, one it could not
remove, an entry refused on import), 2 when it could not run at all (no cache there, a cache or key that is
not trusted, an archive that cannot be imported); the message goes to stderr, and with --json a JSON object
with "error" to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from npu_graph.cache.folder import CorruptEntry, EntryGone
from npu_graph.tools.units import format_size, parse_age, parse_size

if TYPE_CHECKING:  # the cache modules import torch: only the commands that run import them
    from npu_graph.cache.disk_store import DiskCache

Outcome = tuple[Any, str | None]  # what to print, and what went wrong (None: nothing)


class CacheCommandError(Exception):
    """The command cannot run at all (exit code 2)."""


def add_cache_parser(sub: argparse._SubParsersAction) -> None:
    cache = sub.add_parser("cache", help="manage the on-disk compile cache")
    actions = cache.add_subparsers(dest="action", required=True)
    for name, text in [("ls", "list entries"), ("stats", "counters and size"), ("clear", "remove every entry"),
                       ("verify", "check every entry, quarantine those that fail, report stray files")]:
        _common(actions.add_parser(name, help=text))
    show = _common(actions.add_parser("show", help="one entry in full"))
    show.add_argument("key", help="entry key (a unique prefix is enough)")
    prune = _common(actions.add_parser("prune", help="evict least recently used / old entries"))
    prune.add_argument("--max-size", type=parse_size, default=None,
                       help="keep at most this much (500M, 2G: the units `cache ls` prints)")
    prune.add_argument("--older-than", type=parse_age, default=None, help="remove entries unused for (30d, 12h)")
    export = _common(actions.add_parser("export", help="pack the cache into one file"))
    export.add_argument("file")
    imp = _common(actions.add_parser("import", help="unpack an exported cache (versions must match; entries must "
                                                    "carry a tag under your key)"))
    imp.add_argument("file")
    imp.add_argument("--trust", action="store_true",
                     help="accept entries whatever their tag: only for an archive whose origin you trust, since "
                          "its code will run")
    imp.add_argument("--key", metavar="FILE", default=None,
                     help="also accept entries tagged under this key (the cache.key of whoever made the archive)")


def _common(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--dir", default=None, help="cache root")
    return parser


def _entry_row(disk: DiskCache, info: dict[str, Any]) -> dict[str, Any]:
    try:
        meta = disk.read_meta(info["key"])
    except CorruptEntry as exc:
        return {**info, "ok": False, "problem": str(exc)}
    summary = meta.get("summary", {})
    return {**info, "nodes": summary.get("nodes_after"), "fused_ops": summary.get("fused_ops", {}),
            "torch": meta.get("versions", {}).get("torch"), "ok": True}


def _ls(disk: DiskCache, args: argparse.Namespace) -> Outcome:
    return [_entry_row(disk, info) for info in reversed(disk.entries_by_recency())], None


def _show(disk: DiskCache, args: argparse.Namespace) -> Outcome:
    matches = [k for k in disk.entry_keys() if k.startswith(args.key)]
    if not matches:
        raise CacheCommandError(f"no entry matches {args.key!r} in {disk.root}; `ascend-dsa cache ls` lists "
                                f"the keys")
    if len(matches) > 1:
        raise CacheCommandError(f"{len(matches)} entries match {args.key!r}; give more of the key")
    key = matches[0]
    info = disk.entry_info(key)
    try:
        meta = disk.read_meta(key)
    except CorruptEntry as exc:
        return {**info, "ok": False, "problem": str(exc)}, f"entry {key[:12]} is damaged: {exc}"
    return {**info, "ok": True, "graph": meta.get("summary", {}), "config": meta.get("config"),
            "versions": meta.get("versions"), "guards": meta["artifact"]["guards"],
            "created": meta.get("created")}, None


def _verify(disk: DiskCache, args: argparse.Namespace) -> Outcome:
    if disk.key is None:
        raise CacheCommandError(disk.key_problem)
    good, bad = 0, []
    for key in disk.entry_keys():
        try:
            disk.read_meta(key)
            good += 1
        except EntryGone:       # removed by a process using the cache meanwhile
            continue
        except CorruptEntry as exc:
            bad.append({"key": key, "problem": str(exc), "quarantined": disk.quarantine(key)})
    from npu_graph.cache.trace_store import TraceShelf

    shelf = TraceShelf(disk)
    traces = shelf.keys()
    good_traces, bad_traces = shelf.verify()
    bad += [{**row, "trace": True} for row in bad_traces]
    result = {"ok": good, "quarantined": bad, "ignored": disk.unknown_names()}
    if traces:
        result["traces"] = good_traces
    return result, f"{len(bad)} damaged entries" if bad else None


def _removal(result: dict[str, Any]) -> Outcome:
    left = result["left"]
    if not left:
        return result, None
    return result, f"{len(left)} could not be removed: " + "; ".join(f"{k}: {v}" for k, v in left.items())


def _prune(disk: DiskCache, args: argparse.Namespace) -> Outcome:
    return _removal(disk.prune(args.max_size if args.max_size is not None else disk.max_size, args.older_than))


def _clear(disk: DiskCache, args: argparse.Namespace) -> Outcome:
    from npu_graph.cache.trace_store import TraceShelf

    shelf = TraceShelf(disk)
    traces = len(shelf.keys())
    result = disk.clear()
    left = shelf.clear()
    result["removed"] += traces - len(left)
    result["left"].update(left)
    return _removal(result)


def _export(disk: DiskCache, args: argparse.Namespace) -> Outcome:
    from npu_graph.cache.transfer import export_cache

    result = export_cache(disk, args.file)
    skipped = result["skipped"]
    return result, f"{len(skipped)} entries that do not verify were left out" if skipped else None


def _import(disk: DiskCache, args: argparse.Namespace) -> Outcome:
    from npu_graph.cache.transfer import import_cache

    result = import_cache(disk, args.file, trust=args.trust, key_file=args.key)
    refused = result["refused"]
    if not refused:
        return result, None
    reasons = "; ".join(sorted({r["problem"] for r in refused}))
    return result, (f"{len(refused)} entries refused ({reasons}). If you trust where this archive comes from, "
                    f"import it with --trust, or with --key FILE naming the key it was made with")


_ACTIONS: dict[str, Callable[[DiskCache, argparse.Namespace], Outcome]] = {
    "ls": _ls, "show": _show, "stats": lambda disk, args: (disk.stats(), None), "prune": _prune,
    "clear": _clear, "verify": _verify, "export": _export, "import": _import}


def _check_archive(args: argparse.Namespace) -> None:
    """`import FILE` of a file that is not there fails before anything is created."""
    if args.action == "import" and not os.path.isfile(args.file):
        problem = "is a folder" if os.path.isdir(args.file) else "does not exist"
        raise CacheCommandError(f"{args.file} {problem}; give the file `ascend-dsa cache export FILE` wrote")


def run_cache_command(args: argparse.Namespace) -> int:
    """Run one `ascend-dsa cache` action; the exit code is the module's (0, 1 or 2)."""
    from npu_graph.cache.disk_store import DiskCache
    from npu_graph.cache.transfer import CacheImportError

    try:
        _check_archive(args)
        disk = DiskCache(args.dir, create=args.action == "import")
        if disk.refused:
            raise CacheCommandError(disk.refused)
        result, problem = _ACTIONS[args.action](disk, args)
    except (CacheCommandError, CacheImportError, OSError) as exc:
        message = _message(exc)
        print(f"ascend-dsa cache {args.action}: {message}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": message}))
        return 2
    _print(args.action, result, args.json)
    if problem:
        print(f"ascend-dsa cache {args.action}: {problem}", file=sys.stderr)
    return 1 if problem else 0


def _message(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return str(exc)


def _print(action: str, result: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2, default=str))
        return
    console = Console()
    if action == "ls":
        table = Table(title="ascend_dsa compile cache")
        for column in ("key", "size", "last used", "nodes", "fused ops", "ok"):
            table.add_column(column)
        for row in result:
            used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["last_used"]))
            fused = ", ".join(f"{k}×{v}" for k, v in row.get("fused_ops", {}).items()) or "-"
            table.add_row(row["key"][:16], format_size(row["size"]), used, str(row.get("nodes", "")), fused,
                          "yes" if row["ok"] else row.get("problem", "no"))
        console.print(table)
    else:
        console.print_json(json.dumps(result, default=str))

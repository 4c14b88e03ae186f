"""`ascend-dsa cache {ls,show,stats,prune,clear,verify,export,import}`: manage the on-disk compile cache.
Every subcommand takes --json and --dir (default: ASCEND_DSA_CACHE_DIR, else ~/.cache/ascend_dsa)."""
from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from npu_graph.cache_transfer import export_cache, import_cache
from npu_graph.disk_cache import CorruptEntry, DiskCache

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_AGES = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_size(text: str) -> int:
    """"500M", "2G", "4096" -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"size {text!r} is not like 500M, 2G or 4096")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def parse_age(text: str) -> float:
    """"30d", "12h", "90m", "45s" -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"age {text!r} is not like 30d, 12h, 90m or 45s")
    return float(match.group(1)) * _AGES[match.group(2)]


def add_cache_parser(sub: argparse._SubParsersAction) -> None:
    cache = sub.add_parser("cache", help="manage the on-disk compile cache")
    actions = cache.add_subparsers(dest="action", required=True)
    for name, text in [("ls", "list entries"), ("stats", "counters and size"), ("clear", "remove every entry"),
                       ("verify", "read every entry, quarantine bad ones")]:
        _common(actions.add_parser(name, help=text))
    show = _common(actions.add_parser("show", help="one entry in full"))
    show.add_argument("key", help="entry key (a unique prefix is enough)")
    prune = _common(actions.add_parser("prune", help="evict least recently used / old entries"))
    prune.add_argument("--max-size", type=parse_size, default=None, help="keep at most this much (500M, 2G)")
    prune.add_argument("--older-than", type=parse_age, default=None, help="remove entries unused for (30d, 12h)")
    export = _common(actions.add_parser("export", help="pack the cache into one file"))
    export.add_argument("file")
    imp = _common(actions.add_parser("import", help="unpack an exported cache (versions must match)"))
    imp.add_argument("file")


def _common(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--dir", default=None, help="cache root")
    return parser


def _resolve(disk: DiskCache, prefix: str) -> str:
    matches = [k for k in disk.entry_keys() if k.startswith(prefix)]
    if len(matches) != 1:
        raise SystemExit(f"ascend-dsa cache: {len(matches)} entries match {prefix!r}; give more of the key")
    return matches[0]


def _entry_row(disk: DiskCache, info: dict[str, Any]) -> dict[str, Any]:
    try:
        meta = disk.read_meta(info["key"])
        summary = meta.get("summary", {})
        return {**info, "nodes": summary.get("nodes_after"), "fused_ops": summary.get("fused_ops", {}),
                "torch": meta.get("versions", {}).get("torch"), "ok": True}
    except CorruptEntry as exc:
        return {**info, "ok": False, "problem": str(exc)}


def _show(disk: DiskCache, key: str) -> dict[str, Any]:
    meta = disk.read_meta(key)
    return {**disk.entry_info(key), "graph": meta.get("summary", {}), "config": meta.get("config"),
            "versions": meta.get("versions"), "guards": meta["artifact"]["guards"],
            "created": meta.get("created")}


def _verify(disk: DiskCache) -> dict[str, Any]:
    good, bad = [], []
    for key in disk.entry_keys():
        try:
            disk.read_meta(key)
            good.append(key)
        except CorruptEntry as exc:
            disk.quarantine(key, str(exc))
            bad.append({"key": key, "problem": str(exc)})
    return {"ok": len(good), "quarantined": bad}


def _clear(disk: DiskCache) -> dict[str, Any]:
    keys = disk.entry_keys()
    for key in keys:
        disk.remove(key)
    return {"removed": len(keys)}


def run_cache_command(args: argparse.Namespace) -> int:
    disk = DiskCache(args.dir)
    if disk.refused:
        raise SystemExit(f"ascend-dsa cache: {disk.refused}")
    action = args.action
    if action == "ls":
        result: Any = [_entry_row(disk, info) for info in reversed(disk.entries_by_recency())]
    elif action == "show":
        result = _show(disk, _resolve(disk, args.key))
    elif action == "stats":
        result = disk.stats()
    elif action == "prune":
        result = {"removed": disk.prune(args.max_size if args.max_size is not None else disk.max_size,
                                        args.older_than)}
    elif action == "clear":
        result = _clear(disk)
    elif action == "verify":
        result = _verify(disk)
    elif action == "export":
        result = export_cache(disk, args.file)
    else:
        result = import_cache(disk, args.file)
    _print(action, result, args.json)
    return 0


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
            table.add_row(row["key"][:16], str(row["size"]), used, str(row.get("nodes", "")), fused,
                          "yes" if row["ok"] else row.get("problem", "no"))
        console.print(table)
    else:
        console.print_json(json.dumps(result, default=str))

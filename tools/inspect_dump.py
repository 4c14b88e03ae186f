"""Reading a graph dump (the folder `options={"dump_dir": D}` writes) and comparing its stages.

Plain functions returning dicts, shared by `ascend-dsa inspect` and the HTML report. A dump folder holds one
folder per compiled graph (`NNN_<graph>_<pid>/`), each with `NN_<stage>.txt/.json` per stage and
`summary.json`. Naming something that does not exist raises `DumpError`, whose message lists what does.
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from typing import Any

STAGE_FILE = re.compile(r"^(\d+)_(.+)\.json$")
GRAPH_FOLDER = re.compile(r"^(\d+)_(.+)_(\d+)$")
FUSED_PREFIX = "ascend_dsa."
NAME_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class DumpError(Exception):
    """A dump, graph or stage that was asked for does not exist; the message names what does."""


def read_json(path: str) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when it is missing or unreadable (a dump may be partial)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_graph_folder(path: str) -> bool:
    try:
        return any(STAGE_FILE.match(f) or f == "summary.json" for f in os.listdir(path))
    except OSError:
        return False


def _graph_entry(index: int, path: str) -> dict[str, Any]:
    folder = os.path.basename(os.path.normpath(path))
    summary = read_json(os.path.join(path, "summary.json")) or {}
    match = GRAPH_FOLDER.match(folder)
    name = summary.get("graph") or (match.group(2) if match else folder)
    return {"index": index, "folder": folder, "path": path, "graph": name, "summary": summary}


def find_graphs(dump_dir: str) -> list[dict[str, Any]]:
    """Every graph folder in a dump, in folder order (a graph folder itself is a one-graph dump)."""
    if os.path.isfile(dump_dir):
        raise DumpError(f"{dump_dir!r} is a file, not a dump folder; give the folder named by the dump_dir option")
    if not os.path.isdir(dump_dir):
        raise DumpError(f"no dump folder at {dump_dir!r} (compile with options={{'dump_dir': ...}} to write one)")
    root = os.path.abspath(dump_dir)
    if _is_graph_folder(root):
        return [_graph_entry(0, root)]
    folders = sorted(f for f in os.listdir(root) if _is_graph_folder(os.path.join(root, f)))
    if not folders:
        present = ", ".join(sorted(os.listdir(root))[:10]) or "nothing"
        raise DumpError(f"{dump_dir!r} holds no graph folders (NNN_<graph>_<pid>/ with summary.json); "
                        f"it holds: {present}")
    return [_graph_entry(i, os.path.join(root, f)) for i, f in enumerate(folders)]


def _graph_names(graphs: list[dict[str, Any]]) -> str:
    return ", ".join(f"{g['index']}: {g['folder']} ({g['graph']})" for g in graphs)


def resolve_graph(graphs: list[dict[str, Any]], key: str | None) -> dict[str, Any]:
    """The graph named by `key`: its folder name, its graph name or its index in the listing."""
    if key is None:
        if len(graphs) == 1:
            return graphs[0]
        raise DumpError(f"the dump holds {len(graphs)} graphs; choose one with --graph: {_graph_names(graphs)}")
    if key.isdigit() and int(key) < len(graphs):
        return graphs[int(key)]
    matches = [g for g in graphs if key in (g["folder"], g["graph"])]
    if len(matches) == 1:
        return matches[0]
    problem = "is ambiguous" if matches else "is unknown"
    raise DumpError(f"graph {key!r} {problem}; graphs: {_graph_names(matches or graphs)}")


def find_stages(graph: dict[str, Any]) -> list[dict[str, Any]]:
    """The stages dumped for a graph, in pipeline order: [{index, name, json, txt}]."""
    stages = []
    for filename in os.listdir(graph["path"]):
        match = STAGE_FILE.match(filename)
        if match:
            stem = os.path.join(graph["path"], filename[: -len(".json")])
            stages.append({"index": int(match.group(1)), "name": match.group(2), "json": stem + ".json",
                           "txt": stem + ".txt"})
    return sorted(stages, key=lambda s: s["index"])


def resolve_stage(graph: dict[str, Any], stages: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The stage named by `key`: "captured", a pass name, or the stage number (0 = captured)."""
    for stage in stages:
        if key in (stage["name"], str(stage["index"]), f"{stage['index']:02d}"):
            return stage
    listing = ", ".join(f"{s['index']}: {s['name']}" for s in stages) or "none"
    skipped = [p["name"] for p in graph["summary"].get("passes", []) if p.get("skipped")]
    note = f" (skipped passes are not dumped: {', '.join(skipped)})" if skipped else ""
    raise DumpError(f"pass {key!r} is unknown in graph {graph['folder']}; stages: {listing}{note}")


def load_stage(stage: dict[str, Any]) -> dict[str, Any]:
    """A stage's JSON (record fields and nodes) plus its text listing."""
    data = read_json(stage["json"]) or {"stage": stage["name"], "nodes": []}
    try:
        with open(stage["txt"]) as f:
            data["text"] = f.read()
    except OSError:
        data["text"] = ""
    data.setdefault("nodes", [])
    return data


def _streams_count(summary: dict[str, Any]) -> int | None:
    streams = summary.get("streams")
    if isinstance(streams, dict):
        return streams.get("count")
    return streams if isinstance(streams, int) else None


def graph_row(graph: dict[str, Any]) -> dict[str, Any]:
    """One line of the overview: what the compiler did to one graph."""
    s = graph["summary"]
    return {
        "index": graph["index"], "folder": graph["folder"], "graph": graph["graph"],
        "nodes_before": s.get("nodes_before"), "nodes_after": s.get("nodes_after"),
        "fused_ops": s.get("fused_ops", {}), "streams": _streams_count(s),
        "passes_changed": [p["name"] for p in s.get("passes", []) if p.get("changed")],
        "cache": s.get("cache"), "cache_reason": s.get("cache_reason", ""),
        "compile_ms": s.get("timings_ms", {}).get("compile"), "fallback": s.get("fallback"),
        "complete": bool(s),
    }


def node_counts(row: dict[str, Any]) -> str:
    """"before → after" of a graph row, "-" for a graph that was not compiled here (cache hit)."""
    if row["nodes_before"] is None:
        return "-"
    return f"{row['nodes_before']} → {row['nodes_after']}"


def overview(dump_dir: str) -> dict[str, Any]:
    """The dump as a list of graph rows."""
    return {"dump": os.path.abspath(dump_dir), "graphs": [graph_row(g) for g in find_graphs(dump_dir)]}


def graph_stages(dump_dir: str, graph_key: str | None) -> dict[str, Any]:
    """One graph's summary, the list of its dumped stages with node counts, and its near misses (each with the
    canonical expression at the anchor and the first term that differs from the pattern, where the pass read that
    far)."""
    graph = resolve_graph(find_graphs(dump_dir), graph_key)
    stages = []
    for stage in find_stages(graph):
        data = read_json(stage["json"]) or {}
        stages.append({"index": stage["index"], "name": stage["name"], "nodes": len(data.get("nodes", [])),
                       "changed": data.get("changed"), "ms": data.get("ms"), "stats": data.get("stats", {})})
    return {"graph": graph["graph"], "folder": graph["folder"], "summary": graph["summary"], "stages": stages,
            "near_misses": graph["summary"].get("near_misses", [])}


def show_stage(dump_dir: str, graph_key: str | None, stage_key: str) -> dict[str, Any]:
    """One stage of one graph: its record, its text listing and its nodes."""
    graph = resolve_graph(find_graphs(dump_dir), graph_key)
    stage = resolve_stage(graph, find_stages(graph), stage_key)
    data = load_stage(stage)
    return {"graph": graph["graph"], "folder": graph["folder"], "index": stage["index"], **data}


def node_inputs(node: dict[str, Any], names: set[str]) -> list[str]:
    """Names of the nodes a dumped node reads (recovered from its printed args and kwargs)."""
    text = " ".join([*node.get("args", []), *map(str, node.get("kwargs", {}).values())])
    seen: dict[str, None] = {}
    for token in NAME_TOKEN.findall(text):
        if token in names and token != node["name"]:
            seen[token] = None
    return list(seen)


def is_fused(node: dict[str, Any]) -> bool:
    return str(node.get("target", "")).startswith(FUSED_PREFIX)


def _brief(node: dict[str, Any]) -> dict[str, Any]:
    return {"name": node["name"], "op": node.get("op"), "target": node.get("target"),
            "created_by": node.get("created_by"), "shapes": node.get("shapes")}


def fused_counts(nodes: list[dict[str, Any]]) -> dict[str, int]:
    return dict(sorted(Counter(n["target"] for n in nodes if is_fused(n)).items()))


def diff_stages(before: dict[str, Any], after: dict[str, Any], passes: list[str]) -> dict[str, Any]:
    """What changed from stage `before` to stage `after`; `passes` are the passes run in between.

    Nodes are matched by (name, target). `rewired` are matched nodes whose args changed; `created` groups
    the nodes of `after` made by those passes (fused regions), with their op.
    """
    old = {(n["name"], n.get("target")): n for n in before["nodes"]}
    new = {(n["name"], n.get("target")): n for n in after["nodes"]}
    rewired = [_brief(n) for k, n in new.items()
               if k in old and (old[k].get("args"), old[k].get("kwargs")) != (n.get("args"), n.get("kwargs"))]
    created: dict[str, list[dict[str, Any]]] = {p: [] for p in passes}
    for node in after["nodes"]:
        if node.get("created_by") in created:
            created[node["created_by"]].append({**_brief(node), "fused": is_fused(node)})
    fused_before, fused_after = fused_counts(before["nodes"]), fused_counts(after["nodes"])
    return {
        "from": before.get("stage"), "to": after.get("stage"), "passes": passes,
        "nodes_before": len(before["nodes"]), "nodes_after": len(after["nodes"]),
        "added": [_brief(n) for k, n in new.items() if k not in old],
        "removed": [_brief(n) for k, n in old.items() if k not in new],
        "rewired": rewired,
        "fused_regions": [{"pass": p, "nodes": nodes} for p, nodes in created.items() if nodes],
        "fused_ops": {op: {"before": fused_before.get(op, 0), "after": fused_after.get(op, 0)}
                      for op in sorted({*fused_before, *fused_after})},
    }


def diff(dump_dir: str, a: str, b: str, graph_key: str | None = None) -> dict[str, Any]:
    """Diff of stage `a` against stage `b` of one graph (stage names, pass names or numbers)."""
    graph = resolve_graph(find_graphs(dump_dir), graph_key)
    stages = find_stages(graph)
    first, second = resolve_stage(graph, stages, a), resolve_stage(graph, stages, b)
    low, high = sorted((first["index"], second["index"]))
    between = [s["name"] for s in stages if low < s["index"] <= high]
    result = diff_stages(load_stage(first), load_stage(second), between)
    return {"graph": graph["graph"], "folder": graph["folder"], **result}

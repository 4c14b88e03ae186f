"""`ascend-dsa inspect html DUMP -o report.html`: one self-contained HTML file describing a graph dump.

Per graph: the pass list with node counts, per-pass diffs, a picture of the graph (inline SVG, layered by
topological depth; fused ops, streams and superkernels coloured), a stream timeline (one lane per stream,
a bar per node from its modeled start to end, or the serial order when no stream plan exists), and the
quantization, layout, superkernel and near-miss tables. Everything is inline (CSS, JS, SVG): the file opens
without a network. A search box filters node tables and highlights nodes in the pictures.
"""
from __future__ import annotations

import html
import itertools
import json
import os
from typing import Any

from npu_graph.tools import inspect_dump

MAX_SVG_NODES = 400
MAX_DIFF_ROWS = 300
BOX_W, BOX_H, GAP_X, GAP_Y, PAD = 150, 20, 14, 16, 10
STREAM_FILLS = ["#a0cbe8", "#8cd17d", "#ffbe7d", "#f1ce63", "#d4a6c8", "#86bcb6", "#ff9d9a", "#d7b5a6"]
KERNEL_COLOURS = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]
NEUTRAL_FILL, INPUT_FILL, FUSED_STROKE = "#e8edf3", "#f4f4f4", "#d62728"
COST_KEYS = ("us", "time_us", "ms", "time_ms", "latency", "time", "seconds")

CSS = """
body{font:13px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fff}
header{position:sticky;top:0;background:#fafafa;border-bottom:1px solid #ddd;padding:8px 16px;z-index:2}
header h1{font-size:17px;margin:0 0 4px}
main{padding:8px 16px}
#search{width:320px;padding:3px 6px}
table{border-collapse:collapse;margin:6px 0}
th,td{border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top;font-size:12px}
th{background:#f0f0f0}
details{margin:6px 0}
details>summary{cursor:pointer;font-weight:600}
details.graph{border:1px solid #ccc;border-radius:4px;padding:6px 10px;margin:12px 0}
details.graph>summary{font-size:15px}
.scroll{max-height:480px;overflow:auto;border:1px solid #eee}
.note{color:#a15c00}
.legend span{display:inline-block;margin-right:12px}
.legend i{display:inline-block;width:14px;height:10px;margin-right:4px;border:1px solid #888}
svg text{font:10px monospace;pointer-events:none}
g.node.hit rect.box{stroke:#000;stroke-width:3}
g.node.dim,rect.bar.dim{opacity:.25}
rect.bar.hit{stroke:#000;stroke-width:2}
code{font-size:12px}
"""

JS = """
(function(){
  var box=document.getElementById('search'), out=document.getElementById('hits');
  function run(){
    var q=box.value.trim().toLowerCase(), hits=0;
    document.querySelectorAll('[data-search]').forEach(function(el){
      var hit=q!=='' && el.getAttribute('data-search').indexOf(q)>=0;
      if(el.tagName==='TR'){el.hidden=q!=='' && !hit;}
      else{el.classList.toggle('hit',hit);el.classList.toggle('dim',q!=='' && !hit);}
      if(hit){hits++;}
    });
    if(q!==''){document.querySelectorAll('details').forEach(function(d){
      if(d.querySelector('tr[data-search]:not([hidden]),.hit')){d.open=true;}});}
    out.textContent=q===''?'':hits+' matches';
  }
  box.addEventListener('input',run);
  document.body.setAttribute('data-js','ready');
})();
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, (dict, list)):
        return f"<code>{_e(json.dumps(value, default=str))}</code>"
    return _e(value)


def _table(columns: list[str], rows: list[list[Any]], search: list[str] | None = None) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    body = []
    for i, row in enumerate(rows):
        attr = f' data-search="{_e(search[i].lower())}"' if search else ""
        body.append(f"<tr{attr}>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def generic_table(value: Any) -> str:
    """Any summary field as HTML: a dict of dicts or list of dicts as a table, anything else as text."""
    if value is None or value == {} or value == []:
        return "<p>not planned</p>"
    if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):
        keys = list(dict.fromkeys(k for v in value.values() for k in v))
        return _table(["name", *keys], [[name, *(v.get(k) for k in keys)] for name, v in value.items()],
                      [str(name) for name in value])
    if isinstance(value, list) and all(isinstance(v, dict) for v in value):
        keys = list(dict.fromkeys(k for v in value for k in v))
        return _table(keys, [[v.get(k) for k in keys] for v in value], [json.dumps(v, default=str) for v in value])
    if isinstance(value, dict):
        return _table(["key", "value"], [[k, v] for k, v in value.items()], [str(k) for k in value])
    return f"<p>{_cell(value)}</p>"


def _colour(palette: list[str], value: Any, order: list[Any]) -> str:
    return palette[order.index(value) % len(palette)] if value in order else palette[-1]


def _lane_key(value: Any) -> tuple[int, str]:
    """Streams in numeric order whether they are ints or strings ("stream 2" before "stream 10")."""
    return len(str(value)), str(value)


def _stream_of(node: dict[str, Any], plan: dict[str, Any]) -> Any:
    entry = plan.get(node["name"])
    return entry.get("stream") if isinstance(entry, dict) else node.get("stream")


def select_nodes(nodes: list[dict[str, Any]], focus: set[str], cap: int = MAX_SVG_NODES) -> list[dict[str, Any]]:
    """At most `cap` nodes, in graph order: the focus nodes and their neighbourhood first, then the rest
    (computations before inputs, so a truncated picture shows work rather than parameters)."""
    if len(nodes) <= cap:
        return nodes
    names = {n["name"] for n in nodes}
    inputs = {n["name"]: inspect_dump.node_inputs(n, names) for n in nodes}
    neighbours: dict[str, set[str]] = {n["name"]: set() for n in nodes}
    for name, ins in inputs.items():
        for src in ins:
            neighbours[name].add(src)
            neighbours[src].add(name)
    chosen: dict[str, None] = {}
    frontier = [n["name"] for n in nodes if n["name"] in focus]
    while frontier and len(chosen) < cap:
        nxt = []
        for name in frontier:
            if name not in chosen and len(chosen) < cap:
                chosen[name] = None
                nxt.extend(sorted(neighbours[name] - chosen.keys()))
        frontier = nxt
    for n in sorted(nodes, key=lambda n: n["op"] in ("placeholder", "get_attr")):
        if len(chosen) >= cap:
            break
        chosen.setdefault(n["name"])
    return [n for n in nodes if n["name"] in chosen]


def layer_depths(nodes: list[dict[str, Any]]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Row of each node (longest path from the inputs; nodes without inputs sit just above their first
    consumer) and the edges between the given nodes."""
    names = {n["name"] for n in nodes}
    depth: dict[str, int] = {}
    edges: list[tuple[str, str]] = []
    for n in nodes:
        ins = [s for s in inspect_dump.node_inputs(n, names) if s in depth]
        edges.extend((src, n["name"]) for src in ins)
        depth[n["name"]] = 1 + max((depth[s] for s in ins), default=-1)
    sources = set(depth) - {dst for _, dst in edges}
    consumers: dict[str, list[str]] = {}
    for src, dst in edges:
        consumers.setdefault(src, []).append(dst)
    for n in reversed(nodes):
        if n["name"] in sources and n["name"] in consumers:
            depth[n["name"]] = min(depth[c] for c in consumers[n["name"]]) - 1
    return depth, edges


def _place_row(names: list[str], desired: dict[str, float]) -> dict[str, float]:
    xs, next_free = {}, float(PAD)
    for name in sorted(names, key=lambda n: desired[n]):
        xs[name] = max(desired[name], next_free)
        next_free = xs[name] + BOX_W + GAP_X
    return xs


def layout_nodes(nodes: list[dict[str, Any]]) -> tuple[dict[str, tuple[float, float]], list[tuple[str, str]]]:
    """Layered layout: depth is the row; in a row a node sits under the mean x of its inputs (one sweep
    down), and nodes without inputs above the mean x of their consumers (one sweep up)."""
    depth, edges = layer_depths(nodes)
    rows: dict[int, list[str]] = {}
    for name, d in depth.items():
        rows.setdefault(d, []).append(name)
    preds: dict[str, list[str]] = {}
    succs: dict[str, list[str]] = {}
    for src, dst in edges:
        preds.setdefault(dst, []).append(src)
        succs.setdefault(src, []).append(dst)
    x: dict[str, float] = {}

    def mean_x(names: list[str], default: float) -> float:
        return sum(x[n] for n in names) / len(names) if names else default

    for d in sorted(rows):
        x.update(_place_row(rows[d], {n: mean_x(preds.get(n, []), PAD) for n in rows[d]}))
    for d in sorted(rows, reverse=True):
        x.update(_place_row(rows[d], {n: x[n] if n in preds else mean_x(succs.get(n, []), x[n])
                                      for n in rows[d]}))
    low = min(depth.values())
    return {n: (x[n], PAD + (depth[n] - low) * (BOX_H + GAP_Y)) for n in depth}, edges


def _node_style(node: dict[str, Any], plan: dict[str, Any], streams: list[Any], kernels: list[Any]) -> dict:
    stream, kernel = _stream_of(node, plan), node.get("superkernel")
    fill = NEUTRAL_FILL
    if node["op"] in ("placeholder", "get_attr", "output"):
        fill = INPUT_FILL
    elif stream is not None:
        fill = _colour(STREAM_FILLS, stream, streams)
    fused = inspect_dump.is_fused(node)
    created = node.get("created_by") not in (None, "capture")
    return {"fill": fill, "stroke": FUSED_STROKE if fused else "#666", "width": 3 if fused else 1,
            "dash": ' stroke-dasharray="4 2"' if created and not fused else "",
            "kernel": _colour(KERNEL_COLOURS, kernel, kernels) if kernel is not None else None}


def _node_title(node: dict[str, Any], stream: Any) -> str:
    parts = [f"{node['name']} = {node.get('target')}", f"shapes {node.get('shapes')} {node.get('dtypes')}",
             f"created by {node.get('created_by')}"]
    parts += [f"{k} {node[k]}" for k in ("superkernel", "layout", "quant", "cost") if k in node]
    if stream is not None:
        parts.append(f"stream {stream}")
    return "\n".join(parts)


def _svg_node(node: dict[str, Any], xy: tuple[float, float], style: dict, stream: Any) -> str:
    x, y = xy
    label = node["name"] if len(node["name"]) <= 22 else node["name"][:21] + "…"
    stripe = (f'<rect x="{x:.0f}" y="{y:.0f}" width="{BOX_W}" height="4" fill="{style["kernel"]}"/>'
              if style["kernel"] else "")
    return (f'<g class="node" data-name="{_e(node["name"])}" '
            f'data-search="{_e((node["name"] + " " + str(node.get("target"))).lower())}">'
            f"<title>{_e(_node_title(node, stream))}</title>"
            f'<rect class="box" x="{x:.0f}" y="{y:.0f}" width="{BOX_W}" height="{BOX_H}" rx="3" '
            f'fill="{style["fill"]}" stroke="{style["stroke"]}" stroke-width="{style["width"]}"{style["dash"]}/>'
            f'{stripe}<text x="{x + 5:.0f}" y="{y + 14:.0f}">{_e(label)}</text></g>')


def graph_svg(nodes: list[dict[str, Any]], svg_id: str, focus: set[str], plan: dict[str, Any],
              cap: int = MAX_SVG_NODES) -> str:
    """The graph as an inline SVG (at most `cap` nodes, focus neighbourhood first) with a truncation note."""
    shown = select_nodes(nodes, focus, cap)
    if not shown:
        return "<p>no nodes</p>"
    pos, edges = layout_nodes(shown)
    streams = sorted({s for n in nodes if (s := _stream_of(n, plan)) is not None}, key=_lane_key)
    kernels = sorted({n["superkernel"] for n in shown if n.get("superkernel") is not None}, key=str)
    width = max(x for x, _ in pos.values()) + BOX_W + PAD
    height = max(y for _, y in pos.values()) + BOX_H + PAD
    parts = [f'<svg id="{svg_id}" class="graph-svg" width="{width:.0f}" height="{height:.0f}" '
             f'viewBox="0 0 {width:.0f} {height:.0f}" role="img"><g fill="none" stroke="#9aa" stroke-width="1">']
    for src, dst in edges:
        (x1, y1), (x2, y2) = pos[src], pos[dst]
        x1, y1, x2 = x1 + BOX_W / 2, y1 + BOX_H, x2 + BOX_W / 2
        mid = (y1 + y2) / 2
        parts.append(f'<path d="M{x1:.0f} {y1:.0f}C{x1:.0f} {mid:.0f} {x2:.0f} {mid:.0f} {x2:.0f} {y2:.0f}"/>')
    parts.append("</g>")
    for n in shown:
        style = _node_style(n, plan, streams, kernels)
        parts.append(_svg_node(n, pos[n["name"]], style, _stream_of(n, plan)))
    parts.append("</svg>")
    note = (f'<p class="note">showing {len(shown)} of {len(nodes)} nodes: the fused or changed nodes and their '
            f"neighbourhood first, then graph order (the full list is in the node table)</p>"
            if len(shown) < len(nodes) else "")
    return note + _legend(streams, kernels, shown) + f'<div class="scroll">{"".join(parts)}</div>'


def _legend(streams: list[Any], kernels: list[Any], nodes: list[dict[str, Any]]) -> str:
    items = [f'<span><i style="background:{NEUTRAL_FILL}"></i>op (no stream)</span>',
             f'<span><i style="background:{INPUT_FILL}"></i>input / output</span>',
             f'<span><i style="background:#fff;border:3px solid {FUSED_STROKE}"></i>fused ascend_dsa op</span>',
             '<span><i style="background:#fff;border:1px dashed #666"></i>created by a pass</span>']
    items += [f'<span><i style="background:{_colour(STREAM_FILLS, s, streams)}"></i>stream {_e(s)}</span>'
              for s in streams]
    items += [f'<span><i style="background:{_colour(KERNEL_COLOURS, k, kernels)}"></i>superkernel {_e(k)}</span>'
              for k in kernels]
    fused = sum(inspect_dump.is_fused(n) for n in nodes)
    return f'<div class="legend">{"".join(items)} <span>({fused} fused ops shown)</span></div>'


def _cost(node: dict[str, Any]) -> float | None:
    cost = node.get("cost")
    if isinstance(cost, (int, float)) and not isinstance(cost, bool):
        return float(cost)
    if isinstance(cost, dict):
        for key in COST_KEYS:
            if isinstance(cost.get(key), (int, float)):
                return float(cost[key])
    return None


def timeline_bars(nodes: list[dict[str, Any]], streams: dict[str, Any] | None) -> tuple[list[dict], str]:
    """Bars [{name, target, lane, start, end}] from the stream plan, or the serial order without one."""
    plan = (streams or {}).get("nodes") or {}
    by_name = {n["name"]: n for n in nodes}
    if plan:
        bars = [{"name": name, "target": by_name.get(name, {}).get("target"), "lane": f"stream {p.get('stream')}",
                 "start": float(p.get("start", 0)), "end": float(p.get("end", 0)),
                 "fused": inspect_dump.is_fused(by_name.get(name, {}))}
                for name, p in plan.items() if isinstance(p, dict)]
        return sorted(bars, key=lambda b: (b["lane"], b["start"])), "modeled start → end per node, one lane per stream"
    bars, clock = [], 0.0
    costs = [_cost(n) for n in nodes if n["op"] == "call_function"]
    unit = not any(c is not None for c in costs)
    for n in (n for n in nodes if n["op"] == "call_function"):
        length = 1.0 if unit else (_cost(n) or 0.0)
        bars.append({"name": n["name"], "target": n.get("target"), "lane": "serial", "start": clock,
                     "end": clock + length, "fused": inspect_dump.is_fused(n)})
        clock += length
    scale = "one unit per node" if unit else "modeled cost per node"
    return bars, f"no stream plan: serial order ({scale})"


def timeline_svg(nodes: list[dict[str, Any]], streams: dict[str, Any] | None, svg_id: str) -> str:
    """One lane per stream, a bar per node from modeled start to end (serial order without a plan)."""
    bars, caption = timeline_bars(nodes, streams)
    lanes = sorted({b["lane"] for b in bars}, key=_lane_key) or ["serial"]
    total = max((b["end"] for b in bars), default=1.0) or 1.0
    left, plot_w, lane_h, top = 90, 1100, 26, 22
    height = top + lane_h * len(lanes) + 24
    parts = [f'<svg id="{svg_id}" class="timeline-svg" width="{left + plot_w + 20}" height="{height}" role="img">',
             f'<text x="4" y="14">{_e(caption)}</text>']
    for i, lane in enumerate(lanes):
        y = top + i * lane_h
        fill = STREAM_FILLS[i % len(STREAM_FILLS)]
        parts.append(f'<rect class="swatch" x="4" y="{y + 6}" width="12" height="12" fill="{fill}"/>'
                     f'<text x="20" y="{y + 16}">{_e(lane)}</text>'
                     f'<line x1="{left}" y1="{y + lane_h}" x2="{left + plot_w}" y2="{y + lane_h}" stroke="#eee"/>')
    for b in bars:
        y = top + lanes.index(b["lane"]) * lane_h + 3
        x, w = left + b["start"] / total * plot_w, max((b["end"] - b["start"]) / total * plot_w, 0.5)
        fill = STREAM_FILLS[lanes.index(b["lane"]) % len(STREAM_FILLS)]
        stroke = FUSED_STROKE if b["fused"] else ("#555" if w >= 3 else "none")
        parts.append(f'<rect class="bar" x="{x:.2f}" y="{y}" width="{w:.2f}" height="{lane_h - 6}" fill="{fill}" '
                     f'stroke="{stroke}" stroke-width="0.5" data-search="{_e(b["name"].lower())}">'
                     f'<title>{_e(b["name"])} = {_e(b["target"])}: {b["start"]:.4g} → {b["end"]:.4g}</title></rect>')
    axis_y = top + lane_h * len(lanes) + 16
    for k in range(6):
        parts.append(f'<text x="{left + k * plot_w / 5 - 10:.0f}" y="{axis_y}">{total * k / 5:.4g}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _passes_table(graph: dict[str, Any], stages: list[dict[str, Any]]) -> str:
    counts = {s.get("stage"): len(s["nodes"]) for s in stages}
    rows = [[0, "captured", counts.get("captured"), "-", "", "", {}]]
    for i, p in enumerate(graph["summary"].get("passes", []), start=1):
        rows.append([i, p.get("name"), counts.get(p.get("name"), p.get("nodes")), p.get("changed"),
                     p.get("skipped"), p.get("ms"), p.get("stats")])
    return _table(["#", "pass", "nodes", "changed", "skipped", "ms", "stats"], rows)


def _node_rows(nodes: list[dict[str, Any]], columns: list[str]) -> list[list[Any]]:
    return [[n.get(c) for c in columns] for n in nodes[:MAX_DIFF_ROWS]]


def _diff_html(d: dict[str, Any]) -> str:
    head = (f"{_e(d['from'])} → {_e(d['to'])}: nodes {d['nodes_before']} → {d['nodes_after']}, "
            f"+{len(d['added'])} added, −{len(d['removed'])} removed, {len(d['rewired'])} rewired")
    body = []
    if d["fused_ops"]:
        body.append(_table(["fused op", "before", "after"],
                           [[op, c["before"], c["after"]] for op, c in d["fused_ops"].items()]))
    regions = [{**n, "pass": r["pass"]} for r in d["fused_regions"] for n in r["nodes"]]
    sections = [("nodes created by the pass (fused regions)", regions, ["pass", "name", "target", "fused"]),
                ("added", d["added"], ["name", "target", "created_by"]),
                ("removed", d["removed"], ["name", "target", "created_by"]),
                ("rewired (inputs changed)", d["rewired"], ["name", "target", "created_by"])]
    for title, nodes, columns in sections:
        if nodes:
            more = f" (first {MAX_DIFF_ROWS} of {len(nodes)})" if len(nodes) > MAX_DIFF_ROWS else ""
            rows = _node_rows(nodes, columns)
            body.append(f"<h4>{_e(title)}{more}</h4>" +
                        _table(columns, rows, [f"{n['name']} {n.get('target')}" for n in nodes[:MAX_DIFF_ROWS]]))
    return f"<details><summary>{head}</summary>{''.join(body) or '<p>no change</p>'}</details>"


def _meta_table(nodes: list[dict[str, Any]], key: str) -> str:
    tagged = [n for n in nodes if n.get(key) is not None]
    if not tagged:
        return ""
    return (f"<h4>nodes with {key} metadata</h4>" +
            _table(["node", "target", key], [[n["name"], n.get("target"), n[key]] for n in tagged],
                   [f"{n['name']} {n.get('target')}" for n in tagged]))


def _plans_html(summary: dict[str, Any], nodes: list[dict[str, Any]]) -> str:
    parts = []
    for title, key, meta in (("Quantization", "quantized", "quant"), ("Layouts", "layouts", "layout"),
                             ("SuperKernels", "superkernels", "superkernel"),
                             ("Near misses", "near_misses", None)):
        body = generic_table(summary.get(key)) + (_meta_table(nodes, meta) if meta else "")
        parts.append(f"<details open><summary>{title}</summary>{body}</details>")
    return "".join(parts)


def _node_table(nodes: list[dict[str, Any]]) -> str:
    columns = ["name", "op", "target", "shapes", "dtypes", "created_by", "stream", "superkernel", "layout",
               "quant", "cost"]
    return _table(columns, [[n.get(c) for c in columns] for n in nodes],
                  [f"{n['name']} {n.get('target')}" for n in nodes])


def _stage_diffs(stages: list[dict[str, Any]]) -> str:
    diffs = [inspect_dump.diff_stages(a, b, [b.get("stage")]) for a, b in itertools.pairwise(stages)]
    return "".join(_diff_html(d) for d in diffs) or "<p>only the captured stage was dumped</p>"


def _graph_summary_line(graph: dict[str, Any]) -> str:
    row = inspect_dump.graph_row(graph)
    fused = ", ".join(f"{op}×{n}" for op, n in row["fused_ops"].items()) or "none"
    ms = f"{row['compile_ms']:.0f} ms" if isinstance(row["compile_ms"], (int, float)) else "-"
    streams = row["streams"] if row["streams"] is not None else "not planned"
    fallback = f", <b>fell back to eager in {_e(row['fallback'])}</b>" if row["fallback"] else ""
    cache = f"{row['cache']} ({row['cache_reason']})" if row["cache_reason"] else row["cache"]
    return (f"nodes {inspect_dump.node_counts(row)}, fused ops: {_e(fused)}, streams: {streams}, "
            f"cache: {_e(cache)}, compile {ms}{fallback}")


def _pictures(graph: dict[str, Any], stages: list[dict[str, Any]], streams: dict[str, Any] | None) -> str:
    """The graph picture and the stream timeline of the last dumped stage."""
    i, final = graph["index"], stages[-1]["nodes"]
    captured = {n["name"] for n in stages[0]["nodes"]}
    focus = {n["name"] for n in final if inspect_dump.is_fused(n) or n["name"] not in captured
             or n.get("created_by") not in (None, "capture")}
    plan = (streams or {}).get("nodes") or {}
    stream_note = (f"<p>makespan {_e(streams.get('makespan'))} (serial {_e(streams.get('makespan_serial'))}), "
                   f"{_e(streams.get('count'))} streams</p>" if streams else "")
    return (f"<details open><summary>Graph picture ({_e(stages[-1].get('stage'))})</summary>"
            f'{graph_svg(final, f"graph-svg-{i}", focus, plan)}</details>'
            f"<details open><summary>Stream timeline</summary>{stream_note}"
            f'<div class="scroll">{timeline_svg(final, streams, f"timeline-svg-{i}")}</div></details>')


def graph_section(graph: dict[str, Any]) -> str:
    """One graph's part of the report."""
    stages = [inspect_dump.load_stage(s) for s in inspect_dump.find_stages(graph)]
    summary = graph["summary"]
    streams = summary.get("streams") if isinstance(summary.get("streams"), dict) else None
    if stages:
        final = stages[-1]["nodes"]
        body = (f"{_pictures(graph, stages, streams)}"
                f"<details open><summary>Passes</summary>{_passes_table(graph, stages)}</details>"
                f"<details><summary>Per-pass diffs</summary>{_stage_diffs(stages)}</details>"
                f"{_plans_html(summary, final)}"
                f"<details><summary>Nodes of the final stage ({len(final)})</summary>{_node_table(final)}</details>")
    else:
        why = "loaded from the compile cache, not compiled" if summary.get("cache") == "hit" else "dump incomplete"
        body = f'<p class="note">no stages dumped for this graph ({why})</p>{_plans_html(summary, [])}'
    return (f'<details class="graph" id="graph-{graph["index"]}" open><summary>{_e(graph["folder"])}</summary>'
            f"<p>{_graph_summary_line(graph)}</p>{body}</details>")


def _overview_table(graphs: list[dict[str, Any]]) -> str:
    rows = []
    for g in graphs:
        r = inspect_dump.graph_row(g)
        rows.append([r["index"], r["folder"], inspect_dump.node_counts(r),
                     ", ".join(f"{k}×{v}" for k, v in r["fused_ops"].items()),
                     r["streams"] if r["streams"] is not None else "not planned",
                     r["cache"], r["compile_ms"], r["fallback"]])
    return _table(["#", "graph", "nodes before → after", "fused ops", "streams", "cache", "compile ms",
                   "fallback"], rows)


def render_report(dump_dir: str) -> str:
    """The whole report as one HTML string."""
    graphs = inspect_dump.find_graphs(dump_dir)
    sections = "".join(graph_section(g) for g in graphs)
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>ascend_dsa dump report</title><style>{CSS}</style></head><body>"
            "<header><h1>ascend_dsa graph dump</h1>"
            f"<div><code>{_e(os.path.abspath(dump_dir))}</code> · {len(graphs)} graphs · "
            '<input id="search" type="search" placeholder="search nodes (name or op)"> '
            '<span id="hits"></span></div></header>'
            f"<main>{_overview_table(graphs)}{sections}</main><script>{JS}</script></body></html>")


def write_html_report(dump_dir: str, out_path: str) -> str:
    """Write the self-contained HTML report of `dump_dir` to `out_path`; returns the absolute path."""
    text = render_report(dump_dir)
    out = os.path.abspath(out_path)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    return out

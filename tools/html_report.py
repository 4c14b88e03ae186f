"""`ascend-dsa inspect html DUMP -o report.html`: one self-contained HTML file describing a graph dump.

Per graph: the graph picture (html_graph: the fused ops, native kernels and SuperKernel regions, opened
where the fused ops are), the stream timeline (html_timeline), the pass list with node counts, per-pass
diffs, and the quantization, layout, SuperKernel, implementation and near-miss tables (html_tables).
Everything is inline (CSS, JS, SVG): the file opens without a network. A search box filters the tables
and highlights nodes in the pictures.
"""
from __future__ import annotations

import itertools
import os
from typing import Any

from npu_graph.tools import inspect_dump
from npu_graph.tools.html_graph import graph_svg, picture_context
from npu_graph.tools.html_tables import esc, section, table
from npu_graph.tools.html_timeline import timeline_svg

MAX_DIFF_ROWS = 300
# (title, summary key, text when the key is absent, text when it is empty)
PLAN_SECTIONS = (
    ("Quantization", "quantized", "not planned: quantization is off (quant='none') or this dump predates it",
     "nothing quantized"),
    ("Layouts", "layouts", "not planned: the layout pass did not run", "no weight layouts chosen"),
    ("SuperKernels", "superkernels", "not planned: the SuperKernel pass did not run", "no regions"),
    ("Implementations", "implementations", "not recorded: no fused op, or the target chooses none",
     "no fused op"),
    ("Near misses", "near_misses", "not recorded", "none: no pattern almost matched"),
)

CSS = """
body{font:13px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fff}
header{position:sticky;top:0;background:#fafafa;border-bottom:1px solid #ddd;padding:8px 16px;z-index:2}
header h1{font-size:17px;margin:0 0 4px}
main{padding:8px 16px}
#search{width:320px;padding:3px 6px}
table{border-collapse:collapse;margin:6px 0}
th,td{border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top;font-size:12px}
th{background:#f0f0f0}
td table{margin:0}
table.fields td:first-child{font-weight:600}
h4{margin:10px 0 2px}
details{margin:6px 0}
details>summary{cursor:pointer;font-weight:600}
details.graph{border:1px solid #ccc;border-radius:4px;padding:6px 10px;margin:12px 0}
details.graph>summary{font-size:15px}
.scroll{max-height:480px;overflow:auto;border:1px solid #eee}
.scroll.picture{max-height:70vh}
.note{color:#a15c00}
.legend{margin:4px 0}
.legend span{display:inline-block;margin-right:14px}
.legend i{display:inline-block;width:14px;height:10px;margin-right:4px;vertical-align:middle;box-sizing:border-box}
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
  function focus(el){
    if(el.dataset.focused||!el.clientWidth){return;}
    el.scrollLeft=Math.max(0,el.dataset.focusX-el.clientWidth/2);
    el.scrollTop=Math.max(0,el.dataset.focusY-40);
    el.dataset.focused='1';
  }
  function focusAll(){document.querySelectorAll('.picture[data-focus-x]').forEach(focus);}
  document.querySelectorAll('details').forEach(function(d){d.addEventListener('toggle',focusAll);});
  box.addEventListener('input',run);
  focusAll();
  document.body.setAttribute('data-js','ready');
})();
"""


def _passes_table(graph: dict[str, Any], stages: list[dict[str, Any]]) -> str:
    counts = {s.get("stage"): len(s["nodes"]) for s in stages}
    rows = [[0, "captured", counts.get("captured"), "-", "", "", {}]]
    for i, p in enumerate(graph["summary"].get("passes", []), start=1):
        rows.append([i, p.get("name"), counts.get(p.get("name"), p.get("nodes")), p.get("changed"),
                     p.get("skipped"), p.get("ms"), p.get("stats")])
    return table(["#", "pass", "nodes", "changed", "skipped", "ms", "stats"], rows)


def _diff_html(d: dict[str, Any]) -> str:
    head = (f"{esc(d['from'])} → {esc(d['to'])}: nodes {d['nodes_before']} → {d['nodes_after']}, "
            f"+{len(d['added'])} added, −{len(d['removed'])} removed, {len(d['rewired'])} rewired")
    body = []
    if d["fused_ops"]:
        body.append(table(["fused op", "before", "after"],
                          [[op, c["before"], c["after"]] for op, c in d["fused_ops"].items()]))
    regions = [{**n, "pass": r["pass"]} for r in d["fused_regions"] for n in r["nodes"]]
    sections = [("nodes created by the pass (fused regions)", regions, ["pass", "name", "target", "fused"]),
                ("added", d["added"], ["name", "target", "created_by"]),
                ("removed", d["removed"], ["name", "target", "created_by"]),
                ("rewired (inputs changed)", d["rewired"], ["name", "target", "created_by"])]
    for title, nodes, columns in sections:
        if nodes:
            more = f" (first {MAX_DIFF_ROWS} of {len(nodes)})" if len(nodes) > MAX_DIFF_ROWS else ""
            first = nodes[:MAX_DIFF_ROWS]
            body.append(f"<h4>{esc(title)}{more}</h4>" +
                        table(columns, [[n.get(c) for c in columns] for n in first],
                              [f"{n['name']} {n.get('target')}" for n in first]))
    return f"<details><summary>{head}</summary>{''.join(body) or '<p>no change</p>'}</details>"


def _stage_diffs(stages: list[dict[str, Any]]) -> str:
    diffs = [inspect_dump.diff_stages(a, b, [b.get("stage")]) for a, b in itertools.pairwise(stages)]
    return "".join(_diff_html(d) for d in diffs) or "<p>only the captured stage was dumped</p>"


def _meta_table(nodes: list[dict[str, Any]], key: str) -> str:
    tagged = [n for n in nodes if n.get(key) is not None]
    if not tagged:
        return ""
    return (f"<details><summary>nodes with {key} metadata ({len(tagged)})</summary>" +
            table(["node", "target", key], [[n["name"], n.get("target"), n[key]] for n in tagged],
                  [f"{n['name']} {n.get('target')}" for n in tagged]) + "</details>")


def _streams_section(streams: dict[str, Any] | None) -> str:
    """The stream plan's figures and prologs (its per-node plan is the timeline)."""
    if streams is None:
        return "<p>not planned: the stream pass did not run</p>"
    return section({k: v for k, v in streams.items() if k != "nodes"})


def plans_html(summary: dict[str, Any], nodes: list[dict[str, Any]]) -> str:
    """The plan sections of summary.json as tables, each with the per-node metadata it set."""
    parts = []
    meta = {"quantized": "quant", "layouts": "layout", "superkernels": "superkernel"}
    for title, key, absent, empty in PLAN_SECTIONS:
        body = section(summary.get(key), absent, empty) + (_meta_table(nodes, meta[key]) if key in meta else "")
        parts.append(f'<details open class="plan" id="plan-{key}"><summary>{title}</summary>{body}</details>')
    streams = summary.get("streams") if isinstance(summary.get("streams"), dict) else None
    parts.append(f'<details class="plan" id="plan-streams"><summary>Stream plan</summary>'
                 f"{_streams_section(streams)}</details>")
    return "".join(parts)


def _shape_text(node: dict[str, Any]) -> str:
    shapes = [s for s in node.get("shapes") or [] if s is not None]
    return "; ".join("[" + ", ".join(map(str, s)) + "]" for s in shapes)


def _node_table(nodes: list[dict[str, Any]]) -> str:
    columns = ["name", "op", "target", "shapes", "dtypes", "created_by", "stream", "superkernel", "layout",
               "quant", "cost"]
    rows = [[_shape_text(n) if c == "shapes" else n.get(c) for c in columns] for n in nodes]
    return table(columns, rows, [f"{n['name']} {n.get('target')}" for n in nodes])


def _graph_summary_line(graph: dict[str, Any]) -> str:
    row = inspect_dump.graph_row(graph)
    fused = ", ".join(f"{op}×{n}" for op, n in row["fused_ops"].items()) or "none"
    ms = f"{row['compile_ms']:.0f} ms" if isinstance(row["compile_ms"], (int, float)) else "-"
    streams = row["streams"] if row["streams"] is not None else "not planned"
    fallback = f", <b>fell back to eager in {esc(row['fallback'])}</b>" if row["fallback"] else ""
    cache = f"{row['cache']} ({row['cache_reason']})" if row["cache_reason"] else row["cache"]
    return (f"nodes {inspect_dump.node_counts(row)}, fused ops: {esc(fused)}, streams: {streams}, "
            f"cache: {esc(cache)}, compile {ms}{fallback}")


def _pictures(graph: dict[str, Any], stages: list[dict[str, Any]], streams: dict[str, Any] | None) -> str:
    """The graph pictures (the work, and every node) and the stream timeline of the last dumped stage."""
    i, final, stage = graph["index"], stages[-1]["nodes"], esc(stages[-1].get("stage"))
    ctx = picture_context(final, graph["summary"])
    stream_note = (f"<p>makespan {esc(streams.get('makespan'))} (serial {esc(streams.get('makespan_serial'))}), "
                   f"{esc(streams.get('count'))} streams</p>" if streams else "")
    return (f"<details open><summary>Graph picture ({stage}): fused ops, kernels and SuperKernel regions"
            f"</summary>{graph_svg(final, f'graph-svg-{i}', ctx)}</details>"
            f"<details><summary>Graph picture ({stage}): every node</summary>"
            f"{graph_svg(final, f'graph-full-svg-{i}', ctx, compact=False)}</details>"
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
                f"{plans_html(summary, final)}"
                f"<details><summary>Nodes of the final stage ({len(final)})</summary>{_node_table(final)}</details>")
    else:
        why = "loaded from the compile cache, not compiled" if summary.get("cache") == "hit" else "dump incomplete"
        body = f'<p class="note">no stages dumped for this graph ({why})</p>{plans_html(summary, [])}'
    return (f'<details class="graph" id="graph-{graph["index"]}" open><summary>{esc(graph["folder"])}</summary>'
            f"<p>{_graph_summary_line(graph)}</p>{body}</details>")


def _overview_table(graphs: list[dict[str, Any]]) -> str:
    rows = []
    for g in graphs:
        r = inspect_dump.graph_row(g)
        rows.append([r["index"], r["folder"], inspect_dump.node_counts(r),
                     ", ".join(f"{k}×{v}" for k, v in r["fused_ops"].items()),
                     r["streams"] if r["streams"] is not None else "not planned",
                     r["cache"], r["compile_ms"], r["fallback"]])
    return table(["#", "graph", "nodes before → after", "fused ops", "streams", "cache", "compile ms",
                  "fallback"], rows)


def render_report(dump_dir: str) -> str:
    """The whole report as one HTML string."""
    graphs = inspect_dump.find_graphs(dump_dir)
    sections = "".join(graph_section(g) for g in graphs)
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>ascend_dsa dump report</title><style>{CSS}</style></head><body>"
            "<header><h1>ascend_dsa graph dump</h1>"
            f"<div><code>{esc(os.path.abspath(dump_dir))}</code> · {len(graphs)} graphs · "
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

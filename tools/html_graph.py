"""The graph picture of the HTML report: an inline SVG, layered by topological depth.

The main picture shows the work: fused ops, native kernels, SuperKernel regions and other compute ops.
Inputs, `getitem`, view-like ops and stream events are plumbing: they are left out and the edges pass
through them. Each box is filled by its class (a handful of colours, see CLASSES) and carries a stripe in
its stream's colour. The picture opens scrolled to where the fused ops are densest (data-focus-x/y).
"""
from __future__ import annotations

from typing import Any

from npu_graph.tools import inspect_dump
from npu_graph.tools.html_tables import esc

MAX_SVG_NODES = 400
BOX_W, BOX_H, GAP_X, GAP_Y, PAD, STRIPE = 150, 20, 14, 16, 10, 5
FOCUS_WINDOW = 400
LONG_EDGE_ROWS = 4
STREAM_FILLS = ["#4e79a7", "#59a14f", "#f28e2b", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f"]
FUSED_STROKE = "#b22222"
# class: (legend label, fill, stroke, stroke width)
CLASSES = {
    "native": ("fused op, native kernel", "#ff8f6b", FUSED_STROKE, 2),
    "fused": ("fused op (torch implementation)", "#ffd27f", FUSED_STROKE, 2),
    "superkernel": ("SuperKernel region", "#c9b8ef", "#5e3c99", 2),
    "other": ("other op", "#e8edf3", "#777", 1),
    "io": ("input / output", "#f7f7f7", "#aaa", 1),
}
VIEW_OPS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "unsqueeze", "squeeze", "expand",
            "slice", "select", "split", "split_with_sizes", "alias", "detach", "as_strided", "unbind"}


def _aten_name(node: dict[str, Any]) -> str:
    target = str(node.get("target", ""))
    return target.split(".")[1] if target.startswith("aten.") and "." in target[5:] else ""


def is_plumbing(node: dict[str, Any]) -> bool:
    """Nodes the main picture leaves out: inputs, outputs, tuple access, views and stream events."""
    target = str(node.get("target", ""))
    return (node["op"] in ("placeholder", "get_attr", "output") or "getitem" in target
            or "record_event" in target or "wait_event" in target or _aten_name(node) in VIEW_OPS)


def node_class(node: dict[str, Any], impls: dict[str, dict[str, Any]]) -> str:
    """One of CLASSES: `impls` maps a fused node's name to its implementations record (impl: native/torch)."""
    if inspect_dump.is_fused(node):
        return "native" if (impls.get(node["name"]) or {}).get("impl") == "native" else "fused"
    if node["op"] == "call_module" or node.get("superkernel") is not None:
        return "superkernel"
    return "io" if node["op"] in ("placeholder", "get_attr", "output") else "other"


def data_edges(nodes: list[dict[str, Any]], shown: set[str]) -> list[tuple[str, str]]:
    """Edges between the shown nodes; an edge through nodes that are not shown joins their ends."""
    names = {n["name"] for n in nodes}
    reads: dict[str, set[str]] = {}
    edges: list[tuple[str, str]] = []
    for n in nodes:
        sources: set[str] = set()
        for src in inspect_dump.node_inputs(n, names):
            sources |= {src} if src in shown else reads.get(src, set())
        reads[n["name"]] = sources
        if n["name"] in shown:
            edges.extend((src, n["name"]) for src in sorted(sources))
    return edges


def select_nodes(names: list[str], edges: list[tuple[str, str]], focus: set[str],
                 cap: int = MAX_SVG_NODES) -> list[str]:
    """At most `cap` names, in graph order: the focus nodes and their neighbourhood first, then the rest."""
    if len(names) <= cap:
        return names
    neighbours: dict[str, set[str]] = {n: set() for n in names}
    for src, dst in edges:
        neighbours[src].add(dst)
        neighbours[dst].add(src)
    chosen: dict[str, None] = {}
    frontier = [n for n in names if n in focus]
    while frontier and len(chosen) < cap:
        nxt = []
        for name in frontier:
            if name not in chosen and len(chosen) < cap:
                chosen[name] = None
                nxt.extend(sorted(neighbours[name] - chosen.keys()))
        frontier = nxt
    for name in names:
        if len(chosen) >= cap:
            break
        chosen.setdefault(name)
    return [n for n in names if n in chosen]


def layer_depths(names: list[str], edges: list[tuple[str, str]]) -> dict[str, int]:
    """Row of each node: the longest path from the sources; a source sits just above its first consumer."""
    preds: dict[str, list[str]] = {}
    consumers: dict[str, list[str]] = {}
    for src, dst in edges:
        preds.setdefault(dst, []).append(src)
        consumers.setdefault(src, []).append(dst)
    depth: dict[str, int] = {}
    for name in names:
        depth[name] = 1 + max((depth[s] for s in preds.get(name, []) if s in depth), default=-1)
    for name in reversed(names):
        if name not in preds and name in consumers:
            depth[name] = min(depth[c] for c in consumers[name]) - 1
    return depth


def _place_row(names: list[str], desired: dict[str, float]) -> dict[str, float]:
    xs, next_free = {}, float(PAD)
    for name in sorted(names, key=lambda n: desired[n]):
        xs[name] = max(desired[name], next_free)
        next_free = xs[name] + BOX_W + GAP_X
    return xs


def layout_nodes(names: list[str], edges: list[tuple[str, str]]) -> dict[str, tuple[float, float]]:
    """Layered layout: depth is the row; a node sits under the mean x of its inputs (one sweep down), a
    source above the mean x of its consumers (one sweep up)."""
    depth = layer_depths(names, edges)
    rows: dict[int, list[str]] = {}
    for name in names:
        rows.setdefault(depth[name], []).append(name)
    preds: dict[str, list[str]] = {}
    succs: dict[str, list[str]] = {}
    for src, dst in edges:
        preds.setdefault(dst, []).append(src)
        succs.setdefault(src, []).append(dst)
    x: dict[str, float] = {}

    def mean_x(others: list[str], default: float) -> float:
        return sum(x[n] for n in others) / len(others) if others else default

    for d in sorted(rows):
        x.update(_place_row(rows[d], {n: mean_x(preds.get(n, []), PAD) for n in rows[d]}))
    for d in sorted(rows, reverse=True):
        x.update(_place_row(rows[d], {n: x[n] if n in preds else mean_x(succs.get(n, []), x[n])
                                      for n in rows[d]}))
    low = min(depth.values())
    return {n: (x[n], PAD + (depth[n] - low) * (BOX_H + GAP_Y)) for n in names}


def focus_point(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Top-centre of the FOCUS_WINDOW-high band that holds the most of `points` (the fused ops)."""
    if not points:
        return None
    ys = sorted(y for _, y in points)
    best = max(ys, key=lambda top: sum(top <= y < top + FOCUS_WINDOW for y in ys))
    band = [x for x, y in points if best <= y < best + FOCUS_WINDOW]
    return sum(band) / len(band) + BOX_W / 2, best


def _stream_colour(stream: Any, streams: list[Any]) -> str:
    return STREAM_FILLS[streams.index(stream) % len(STREAM_FILLS)]


def _title(node: dict[str, Any], stream: Any, impl: dict[str, Any] | None, region: dict | None) -> str:
    parts = [f"{node['name']} = {node.get('target')}", f"shapes {node.get('shapes')} {node.get('dtypes')}",
             f"created by {node.get('created_by')}"]
    parts += [f"{k} {node[k]}" for k in ("superkernel", "layout", "quant", "cost") if k in node]
    if stream is not None:
        parts.append(f"stream {stream}")
    if impl:
        parts.append(f"implementation {impl.get('impl')}: {impl.get('why', '')}")
    if region:
        parts.append(f"SuperKernel of {region.get('ops')} ops ({region.get('nodes')} nodes)")
    return "\n".join(parts)


def _label(node: dict[str, Any], region: dict | None) -> str:
    text = node["name"] + (f" · {region['ops']} ops" if region and "ops" in region else "")
    return text if len(text) <= 22 else text[:21] + "…"


def svg_node(node: dict[str, Any], xy: tuple[float, float], klass: str, ctx: dict[str, Any]) -> str:
    """One box: fill and border by class, a stream stripe on the left, dashed when a pass created it."""
    x, y = xy
    stream = ctx["plan"].get(node["name"], {}).get("stream", node.get("stream"))
    region, impl = ctx["regions"].get(node["name"]), ctx["impls"].get(node["name"])
    _, fill, stroke, width = CLASSES[klass]
    created = node.get("created_by") not in (None, "capture") and klass in ("other", "io")
    dash = ' stroke-dasharray="4 2"' if created else ""
    stripe = (f'<rect x="{x:.0f}" y="{y:.0f}" width="{STRIPE}" height="{BOX_H}" '
              f'fill="{_stream_colour(stream, ctx["streams"])}"/>' if stream in ctx["streams"] else "")
    search = esc(f"{node['name']} {node.get('target')}".lower())
    return (f'<g class="node {klass}" data-name="{esc(node["name"])}" data-search="{search}">'
            f"<title>{esc(_title(node, stream, impl, region))}</title>"
            f'<rect class="box" x="{x:.0f}" y="{y:.0f}" width="{BOX_W}" height="{BOX_H}" rx="3" '
            f'fill="{fill}" stroke="{stroke}" stroke-width="{width}"{dash}/>{stripe}'
            f'<text x="{x + STRIPE + 4:.0f}" y="{y + 14:.0f}">{esc(_label(node, region))}</text></g>')


def _edges_svg(edges: list[tuple[str, str]], pos: dict[str, tuple[float, float]]) -> str:
    """Edges as curves; an edge that skips more than LONG_EDGE_ROWS rows is drawn faint."""
    parts = ['<g fill="none" stroke="#8a9ba8" stroke-width="1">']
    for src, dst in edges:
        (x1, y1), (x2, y2) = pos[src], pos[dst]
        faint = ' stroke-opacity="0.3"' if y2 - y1 > LONG_EDGE_ROWS * (BOX_H + GAP_Y) else ""
        x1, y1, x2 = x1 + BOX_W / 2, y1 + BOX_H, x2 + BOX_W / 2
        mid = (y1 + y2) / 2
        parts.append(f'<path d="M{x1:.0f} {y1:.0f}C{x1:.0f} {mid:.0f} {x2:.0f} {mid:.0f} {x2:.0f} {y2:.0f}"{faint}/>')
    return "".join(parts) + "</g>"


def legend(streams: list[Any], counts: dict[str, int]) -> str:
    """The colour classes present in the picture, one entry per stream stripe, and the 'created' border."""
    items = [f'<span><i style="background:{fill};border:{width}px solid {stroke}"></i>{esc(label)} '
             f"({counts[klass]})</span>"
             for klass, (label, fill, stroke, width) in CLASSES.items() if counts.get(klass)]
    items.append('<span><i style="background:#fff;border:1px dashed #666"></i>other op created by a pass</span>')
    shown = streams[:len(STREAM_FILLS)]
    items += [f'<span><i style="background:{_stream_colour(s, streams)}"></i>stream {esc(s)}</span>' for s in shown]
    if len(streams) > len(shown):
        items.append(f"<span>(stream colours repeat: {len(streams)} streams)</span>")
    return f'<div class="legend">{"".join(items)}</div>'


def graph_svg(nodes: list[dict[str, Any]], svg_id: str, ctx: dict[str, Any], compact: bool = True,
              cap: int = MAX_SVG_NODES) -> str:
    """The picture with its legend: `compact` leaves out the plumbing (is_plumbing); `ctx` holds the stream
    plan, the implementations and the SuperKernel regions by node name (see picture_context)."""
    kept = [n for n in nodes if not (compact and is_plumbing(n))] or nodes
    kept_names = {n["name"] for n in kept}
    edges = data_edges(nodes, kept_names)
    classes = {n["name"]: node_class(n, ctx["impls"]) for n in kept}
    focus = {name for name, k in classes.items() if k in ("fused", "native")}
    names = select_nodes([n["name"] for n in kept], edges, focus, cap)
    if not names:
        return "<p>no nodes</p>"
    chosen = set(names)
    edges = [(s, d) for s, d in edges if s in chosen and d in chosen]
    pos = layout_nodes(names, edges)
    width = max(x for x, _ in pos.values()) + BOX_W + PAD
    height = max(y for _, y in pos.values()) + BOX_H + PAD
    by_name = {n["name"]: n for n in kept}
    boxes = [svg_node(by_name[name], pos[name], classes[name], ctx) for name in names]
    point = focus_point([pos[name] for name in names if name in focus])
    focus_attr = f' data-focus-x="{point[0]:.0f}" data-focus-y="{point[1]:.0f}"' if point else ""
    counts: dict[str, int] = {}
    for name in names:
        counts[classes[name]] = counts.get(classes[name], 0) + 1
    hidden = len(nodes) - len(kept)
    note = []
    if hidden:
        note.append(f"{hidden} inputs, getitem, view and stream-event nodes left out (edges pass through them)")
    if len(names) < len(kept):
        note.append(f"showing {len(names)} of {len(kept)} nodes: the fused ops and their neighbourhood first")
    note_html = f'<p class="note">{esc("; ".join(note))}</p>' if note else ""
    return (note_html + legend(ctx["streams"], counts) + f'<div class="scroll picture"{focus_attr}>'
            f'<svg id="{svg_id}" class="graph-svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img">{_edges_svg(edges, pos)}{"".join(boxes)}</svg></div>')


def picture_context(nodes: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
    """What the boxes need from summary.json: stream plan, streams in order, implementations, regions."""
    streams = summary.get("streams") if isinstance(summary.get("streams"), dict) else {}
    plan = {k: v for k, v in (streams.get("nodes") or {}).items() if isinstance(v, dict)}
    used = {p.get("stream") for p in plan.values()} | {n.get("stream") for n in nodes}
    impls = summary.get("implementations") if isinstance(summary.get("implementations"), list) else []
    kernels = summary.get("superkernels") if isinstance(summary.get("superkernels"), dict) else {}
    return {"plan": plan, "streams": sorted((s for s in used if s is not None), key=lambda s: (len(str(s)), str(s))),
            "impls": {i["node"]: i for i in impls if isinstance(i, dict) and "node" in i},
            "regions": {r["name"]: r for r in kernels.get("regions", []) if isinstance(r, dict) and "name" in r}}

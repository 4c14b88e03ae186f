"""The stream timeline of the HTML report: one lane per stream, a bar per node from its modeled start to
end (the serial order, one unit or its modeled cost per node, when the graph has no stream plan)."""
from __future__ import annotations

from typing import Any

from npu_graph.tools import inspect_dump
from npu_graph.tools.html_graph import FUSED_STROKE, STREAM_FILLS
from npu_graph.tools.html_tables import esc

COST_KEYS = ("us", "time_us", "ms", "time_ms", "latency", "time", "seconds")


def lane_key(value: Any) -> tuple[int, str]:
    """Streams in numeric order whether they are ints or strings ("stream 2" before "stream 10")."""
    return len(str(value)), str(value)


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
    """Bars [{name, target, lane, start, end, fused}] from the stream plan, or the serial order without one."""
    plan = (streams or {}).get("nodes") or {}
    by_name = {n["name"]: n for n in nodes}
    if plan:
        bars = [{"name": name, "target": by_name.get(name, {}).get("target"), "lane": f"stream {p.get('stream')}",
                 "start": float(p.get("start", 0)), "end": float(p.get("end", 0)),
                 "fused": inspect_dump.is_fused(by_name.get(name, {}))}
                for name, p in plan.items() if isinstance(p, dict)]
        return sorted(bars, key=lambda b: (b["lane"], b["start"])), "modeled start → end per node, one lane per stream"
    bars, clock = [], 0.0
    work = [n for n in nodes if n["op"] == "call_function"]
    unit = all(_cost(n) is None for n in work)
    for n in work:
        length = 1.0 if unit else (_cost(n) or 0.0)
        bars.append({"name": n["name"], "target": n.get("target"), "lane": "serial", "start": clock,
                     "end": clock + length, "fused": inspect_dump.is_fused(n)})
        clock += length
    scale = "one unit per node" if unit else "modeled cost per node"
    return bars, f"no stream plan: serial order ({scale})"


def timeline_svg(nodes: list[dict[str, Any]], streams: dict[str, Any] | None, svg_id: str) -> str:
    """One lane per stream, a bar per node from modeled start to end (serial order without a plan)."""
    bars, caption = timeline_bars(nodes, streams)
    lanes = sorted({b["lane"] for b in bars}, key=lane_key) or ["serial"]
    total = max((b["end"] for b in bars), default=1.0) or 1.0
    left, plot_w, lane_h, top = 90, 1100, 26, 22
    height = top + lane_h * len(lanes) + 24
    parts = [f'<svg id="{svg_id}" class="timeline-svg" width="{left + plot_w + 20}" height="{height}" role="img">',
             f'<text x="4" y="14">{esc(caption)} (fused ops outlined)</text>']
    for i, lane in enumerate(lanes):
        y = top + i * lane_h
        fill = STREAM_FILLS[i % len(STREAM_FILLS)]
        parts.append(f'<rect class="swatch" x="4" y="{y + 6}" width="12" height="12" fill="{fill}"/>'
                     f'<text x="20" y="{y + 16}">{esc(lane)}</text>'
                     f'<line x1="{left}" y1="{y + lane_h}" x2="{left + plot_w}" y2="{y + lane_h}" stroke="#eee"/>')
    for b in bars:
        y = top + lanes.index(b["lane"]) * lane_h + 3
        x, w = left + b["start"] / total * plot_w, max((b["end"] - b["start"]) / total * plot_w, 0.5)
        fill = STREAM_FILLS[lanes.index(b["lane"]) % len(STREAM_FILLS)]
        stroke = FUSED_STROKE if b["fused"] else ("#fff" if w >= 3 else "none")
        parts.append(f'<rect class="bar" x="{x:.2f}" y="{y}" width="{w:.2f}" height="{lane_h - 6}" fill="{fill}" '
                     f'fill-opacity="0.75" stroke="{stroke}" stroke-width="{1.5 if b["fused"] else 0.5}" '
                     f'data-search="{esc(b["name"].lower())}">'
                     f'<title>{esc(b["name"])} = {esc(b["target"])}: {b["start"]:.4g} → {b["end"]:.4g}</title></rect>')
    axis_y = top + lane_h * len(lanes) + 16
    for k in range(6):
        parts.append(f'<text x="{left + k * plot_w / 5 - 10:.0f}" y="{axis_y}">{total * k / 5:.4g}</text>')
    parts.append("</svg>")
    return "".join(parts)

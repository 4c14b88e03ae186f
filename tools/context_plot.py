"""`bench context --plot FILE`: decode ms/token against context (log-log) for every row, with ascend_dsa's
roofline floor and dense MLA's, as a self-contained SVG (no plotting library needed)."""
from __future__ import annotations

import math
from html import escape
from pathlib import Path
from typing import Any

WIDTH, HEIGHT = 760, 460
LEFT, RIGHT, TOP, BOTTOM = 70, 190, 40, 50
COLORS = {"dense_eager": "#9e9e9e", "dense_inductor": "#424242", "dsa_eager": "#90caf9", "dsa_inductor": "#1565c0",
          "ascend_dsa": "#d84315", "ascend_dsa_fp8": "#f9a825", "floor ascend_dsa": "#d84315",
          "floor dense": "#424242"}
DASHED = {"floor ascend_dsa", "floor dense"}


def series(result: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """{label: [(context, ms)]} of the decode rows (one token) and of two floors."""
    out: dict[str, list[tuple[int, float]]] = {}
    for p in result["points"]:
        if p["phase"] != "decode" or p["tokens"] != 1:
            continue
        out.setdefault(p["row"], []).append((p["context"], p["ms"]))
        floor = {"ascend_dsa": "floor ascend_dsa", "dense_eager": "floor dense"}.get(p["row"])
        if floor:
            out.setdefault(floor, []).append((p["context"], p["floor_ms"]))
    return {label: sorted(points) for label, points in out.items()}


def _scale(lo: float, hi: float, size: int, start: int, flip: bool):
    lo, hi = math.log10(lo), math.log10(hi if hi > lo else lo * 10)

    def to_pixel(v: float) -> float:
        f = (math.log10(v) - lo) / (hi - lo)
        return start + (1 - f if flip else f) * size
    return to_pixel


def svg(result: dict[str, Any]) -> str:
    lines = series(result)
    xs = [c for pts in lines.values() for c, _ in pts]
    ys = [ms for pts in lines.values() for _, ms in pts]
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    x_of = _scale(min(xs), max(xs), plot_w, LEFT, False)
    y_lo, y_hi = 10 ** math.floor(math.log10(min(ys))), 10 ** math.ceil(math.log10(max(ys)))
    y_of = _scale(y_lo, y_hi, plot_h, TOP, True)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
             'font-size="12"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{LEFT}" y="22" font-size="14">{escape(title(result))}</text>']
    decade = y_lo
    while decade <= y_hi * 1.0001:
        y = y_of(decade)
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e0e0e0"/>'
                     f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{decade:g} ms</text>')
        decade *= 10
    for context in sorted(set(xs)):
        x = x_of(context)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + plot_h}" stroke="#f0f0f0"/>'
                     f'<text x="{x:.1f}" y="{TOP + plot_h + 18}" text-anchor="middle">{context // 1024}K</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 8}" text-anchor="middle">context (tokens), decode '
                 'of one token</text>')
    for i, (label, pts) in enumerate(lines.items()):
        color, dash = COLORS.get(label, "#000"), ' stroke-dasharray="6 4"' if label in DASHED else ""
        path = " ".join(f"{x_of(c):.1f},{y_of(ms):.1f}" for c, ms in pts)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        parts += [f'<circle cx="{x_of(c):.1f}" cy="{y_of(ms):.1f}" r="3" fill="{color}"/>' for c, ms in pts]
        y = TOP + 16 * i + 8
        parts.append(f'<line x1="{WIDTH - RIGHT + 12}" x2="{WIDTH - RIGHT + 36}" y1="{y}" y2="{y}" stroke="{color}" '
                     f'stroke-width="2"{dash}/><text x="{WIDTH - RIGHT + 42}" y="{y + 4}">{escape(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def title(result: dict[str, Any]) -> str:
    machine = result.get("machine", {})
    return (f"DeepSeek-V3.2-sized layer, decode ms/token — {machine.get('cpu', 'CPU')}, "
            f"{machine.get('threads', '?')} threads, {result.get('isa', '?')}")


def write_plot(result: dict[str, Any], path: str) -> None:
    Path(path).write_text(svg(result), encoding="utf-8")

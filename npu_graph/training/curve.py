"""The loss curve of a training run as a small self-contained SVG (no plotting library needed)."""
from __future__ import annotations

from pathlib import Path

WIDTH, HEIGHT, PAD = 640, 360, 48


def _points(values: list[tuple[float, float]], x_max: float, y_min: float, y_max: float) -> str:
    span_y = (y_max - y_min) or 1.0
    return " ".join(f"{PAD + (WIDTH - 2 * PAD) * x / (x_max or 1):.1f},"
                    f"{HEIGHT - PAD - (HEIGHT - 2 * PAD) * (y - y_min) / span_y:.1f}" for x, y in values)


def write_svg(path: Path, train: list[tuple[int, float]], heldout: list[tuple[int, float]], title: str) -> Path:
    """Training loss per step (bits per byte) and held-out evaluations, with the axes' ranges labelled."""
    values = [y for _, y in train + heldout]
    y_min, y_max = min(values, default=0.0), max(values, default=1.0)
    x_max = max((x for x, _ in train + heldout), default=1)
    lines = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
        f'font-size="12">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{PAD}" y="20" font-size="14">{title}</text>',
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="black"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="black"/>',
        f'<text x="{PAD}" y="{HEIGHT - PAD + 16}">0</text>',
        f'<text x="{WIDTH - PAD}" y="{HEIGHT - PAD + 16}" text-anchor="end">step {x_max}</text>',
        f'<text x="{PAD - 4}" y="{PAD + 4}" text-anchor="end">{y_max:.2f}</text>',
        f'<text x="{PAD - 4}" y="{HEIGHT - PAD}" text-anchor="end">{y_min:.2f}</text>',
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" '
        f'points="{_points(train, x_max, y_min, y_max)}"/>',
        f'<polyline fill="none" stroke="#d62728" stroke-width="2" '
        f'points="{_points(heldout, x_max, y_min, y_max)}"/>',
        f'<text x="{WIDTH - PAD}" y="{PAD}" text-anchor="end" fill="#1f77b4">training bits/byte</text>',
        f'<text x="{WIDTH - PAD}" y="{PAD + 16}" text-anchor="end" fill="#d62728">held-out bits/byte</text>',
        "</svg>",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path

"""HTML tables for the report: any summary section (layouts, quantization, SuperKernels, near misses, ...)
as key/value and row tables, nested values as short text or nested tables, never as a JSON blob."""
from __future__ import annotations

import html
from typing import Any

MAX_INLINE_ITEMS = 12
SCROLL_ROWS = 25


def esc(value: Any) -> str:
    """`value` as escaped HTML text (attribute-safe)."""
    return html.escape(str(value), quote=True)


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _records(value: Any) -> bool:
    """A list of dicts or a dict of dicts: a table of its own."""
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, dict) for v in value)
    return isinstance(value, dict) and bool(value) and all(isinstance(v, dict) for v in value.values())


def _number(value: float) -> str:
    if not isinstance(value, float):
        return str(value)
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def cell(value: Any) -> str:
    """One value inside a table cell: scalars as text, lists and dicts inline (a dict inside a dict in
    braces), a list of records as a nested table."""
    if value is None or value == "" or value == [] or value == {}:
        return "-"
    if isinstance(value, (bool, str)):
        return esc(value)
    if isinstance(value, (int, float)):
        return esc(_number(value))
    if isinstance(value, list) and _records(value):
        return records_table(value)
    if isinstance(value, (list, tuple)):
        items = [cell(v) for v in value[:MAX_INLINE_ITEMS]]
        more = f" … ({len(value)} in all)" if len(value) > MAX_INLINE_ITEMS else ""
        text = ", ".join(items) + more
        return f"[{text}]" if any(not _scalar(v) for v in value) or len(value) > 1 else text
    if isinstance(value, dict):
        pairs = list(value.items())
        items = [f"{esc(k)}: {{{cell(v)}}}" if isinstance(v, dict) and v else f"{esc(k)}: {cell(v)}"
                 for k, v in pairs[:MAX_INLINE_ITEMS]]
        more = f" … ({len(pairs)} in all)" if len(pairs) > MAX_INLINE_ITEMS else ""
        return "; ".join(items) + more
    return esc(value)


def _search_text(values: list[Any]) -> str:
    return " ".join(str(v) for v in values if _scalar(v) and v is not None).lower()


def table(columns: list[str], rows: list[list[Any]], search: list[str] | None = None,
          css_class: str = "") -> str:
    """A table; `search` (one string per row) makes the rows answer the search box."""
    head = "".join(f"<th>{esc(c)}</th>" for c in columns)
    body = []
    for i, row in enumerate(rows):
        attr = f' data-search="{esc(search[i].lower())}"' if search else ""
        body.append(f"<tr{attr}>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>")
    klass = f' class="{css_class}"' if css_class else ""
    return f"<table{klass}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def records_table(value: list[dict[str, Any]] | dict[str, dict[str, Any]]) -> str:
    """A list of dicts (one row each) or a dict of dicts (a `name` column first) as one table."""
    if isinstance(value, dict):
        value = [{"name": name, **row} for name, row in value.items()]
    columns = list(dict.fromkeys(k for row in value for k in row))
    rows = [[row.get(c) for c in columns] for row in value]
    return table(columns, rows, [_search_text(r) for r in rows])


def _titled_records(title: str | None, value: Any) -> str:
    """A heading (when titled) and the table; a long table scrolls in a box of its own."""
    body = records_table(value)
    if len(value) > SCROLL_ROWS:
        body = f'<div class="scroll">{body}</div>'
    return (f"<h4>{esc(title)} ({len(value)})</h4>" if title else "") + body


def section(value: Any, absent: str = "not planned", empty: str = "none") -> str:
    """A whole summary section: plain fields as a key/value table, each list of records as its own table."""
    if value is None:
        return f"<p>{esc(absent)}</p>"
    if value == [] or value == {}:
        return f"<p>{esc(empty)}</p>"
    if _records(value):
        return _titled_records(None, value)
    if not isinstance(value, dict):
        return f"<p>{cell(value)}</p>"
    plain = [[k, v] for k, v in value.items() if not _records(v)]
    parts = [table(["field", "value"], plain, css_class="fields")] if plain else []
    parts += [_titled_records(k, v) for k, v in value.items() if _records(v)]
    return "".join(parts)

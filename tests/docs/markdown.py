"""Reading the repository's Markdown for the documentation tests: its files, sections, code blocks, links and
the `ascend-dsa` commands it names."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^```(\w*)\s*$")


def documents() -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def sections(text: str, level: int = 2) -> dict[str, str]:
    """Heading text -> the text under it, up to the next heading of the same or a higher level."""
    marker = "#" * level + " "
    out: dict[str, str] = {}
    title: str | None = None
    lines: list[str] = []
    for line, marked in zip(text.split("\n"), _outside_code(text)):
        if re.match(rf"#{{1,{level}}} ", marked):
            if title is not None:
                out[title] = "\n".join(lines)
            title, lines = (line[len(marker):].strip() if line.startswith(marker) else None), []
        elif title is not None:
            lines.append(line)
    if title is not None:
        out[title] = "\n".join(lines)
    return out


def _outside_code(text: str) -> list[str]:
    """The lines of `text`, each code block's lines prefixed with a space (so no code line reads as a heading)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if _FENCE.match(line.strip()) and line.startswith("```"):
            fenced = not fenced
            out.append(line)
        else:
            out.append(" " + line if fenced else line)
    return out


def code_blocks(text: str, language: str) -> list[str]:
    """The bodies of the fenced code blocks of `language` in `text`, in order."""
    blocks, body, lang = [], None, None
    for line in text.split("\n"):
        fence = _FENCE.match(line.strip()) if line.startswith("```") else None
        if fence and body is None:
            body, lang = [], fence.group(1)
        elif line.startswith("```") and body is not None:
            if lang == language:
                blocks.append("\n".join(body))
            body = None
        elif body is not None:
            body.append(line)
    return blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in _outside_code(path.read_text()) if re.match(r"#+ ", line)}


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link in `path` outside code blocks."""
    return [(n, m.group(1)) for n, line in enumerate(_outside_code(path.read_text()), 1)
            for m in _LINK.finditer(line)]


_COMMAND = re.compile(r"(?:ascend-dsa|python -m npu_graph)((?: +[^ `|;&)]+)*)")


def commands(path: Path) -> list[tuple[int, str]]:
    """(line number, arguments) of every `ascend-dsa ...` or `python -m npu_graph ...` command in `path`: in inline
    code spans and in shell code blocks."""
    found = []
    in_shell = False
    for n, line in enumerate(path.read_text().split("\n"), 1):
        fence = _FENCE.match(line.strip()) if line.startswith("```") else None
        if fence:
            in_shell = not in_shell and fence.group(1) in ("bash", "sh", "console")
            continue
        spans = [line.split("#", 1)[0]] if in_shell else re.findall(r"`([^`]+)`", line)
        for span in spans:
            for m in _COMMAND.finditer(span):
                found.append((n, m.group(1).strip()))
    return found

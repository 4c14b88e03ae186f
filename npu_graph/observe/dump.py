"""Graph dumps: one folder per graph under `dump_dir`, `NNN_<graph>_<compile id>_<pid>` (NNN: creation order
within that folder; the compile id is Dynamo's, "0/0" written `c0-0`, the id TORCH_TRACE and TORCH_LOGS lines
carry), with a text and a JSON file per stage, the generated source and `summary.json`.

Dumping can never break compilation: a write error is logged once per graph and compilation goes on; a full
disk is logged once per dump folder and process, and nothing more is written there.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from npu_graph.observe.report import GraphReport

log = logging.getLogger("npu_graph")

NODE_META_KEYS = ("created_by", "stream", "superkernel", "layout", "quant", "cost")

_create_lock = threading.Lock()
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_full_roots: set[str] = set()  # dump roots whose disk filled up in this process


def current_compile_id() -> str | None:
    """Dynamo's id of the compile under way ("0/0", "1/0_1"), or None outside one."""
    try:
        compile_id = torch._guards.CompileContext.current_compile_id()
    except Exception:  # an id is a convenience: never worth failing a compile for
        return None
    return None if compile_id is None else str(compile_id)


def folder_name(index: int, graph_name: str, compile_id: str | None) -> str:
    """`NNN_<graph>_c<frame>-<compile>_<pid>` (module docstring); without a compile id, `NNN_<graph>_<pid>`."""
    tag = f"c{re.sub(r'[^0-9A-Za-z_]+', '-', compile_id).strip('-')}_" if compile_id else ""
    return f"{index:03d}_{graph_name}_{tag}{os.getpid()}"


def _disk_full(root: str, exc: OSError) -> bool:
    """True (and one warning per root and process) when `exc` says the disk holding `root` is full."""
    if exc.errno not in _DISK_FULL:
        return False
    with _create_lock:
        first = root not in _full_roots
        _full_roots.add(root)
    if first:
        log.warning("ascend_dsa: the disk holding dump_dir %s is full (%s); no more dumps are written there by this "
                    "process, compilation goes on", root, exc.strerror)
    return True


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 200 else text[:197] + "..."


def describe_node(node: torch.fx.Node) -> dict[str, Any]:
    """Everything a person asks about a node: op, shapes, dtypes, and the metadata passes attached."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    info: dict[str, Any] = {
        "name": node.name,
        "op": node.op,
        "target": _short(node.target),
        "args": [_short(a) for a in node.args],
        "kwargs": {k: _short(v) for k, v in node.kwargs.items()},
        "shapes": [[str(s) for s in v.shape] if isinstance(v, torch.Tensor) else None for v in vals],
        "dtypes": [str(v.dtype).replace("torch.", "") if isinstance(v, torch.Tensor) else None
                   for v in vals],
    }
    for key in NODE_META_KEYS:
        if key in node.meta:
            info[key] = node.meta[key]
    return info


def describe_graph(gm: torch.fx.GraphModule) -> list[dict[str, Any]]:
    return [describe_node(n) for n in gm.graph.nodes]


def stage_json(record: dict[str, Any], nodes: list[dict[str, Any]]) -> str:
    """A stage's JSON: its record indented, then its nodes one per line (json's C encoder, which indentation
    would switch off: a decoder graph's stages took seconds each)."""
    head = json.dumps(record, indent=1, default=str)
    lines = ",\n".join(json.dumps(node, default=str) for node in nodes)
    return f'{head[:-2]},\n "nodes": [\n{lines}\n ]\n}}'


def graph_text(gm: torch.fx.GraphModule) -> str:
    """Readable listing of the graph with shapes and dtypes (what print_readable shows)."""
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


class GraphDump:
    """Writer for one graph's dump folder."""

    def __init__(self, folder: str):
        self.folder = folder
        self.failed = False
        self._listing: str | None = None  # the last stage's graph listing

    @classmethod
    def create(cls, root: str, graph_name: str) -> GraphDump | None:
        """The dump writer of a new graph folder under `root`, or None when none can be made (one warning)."""
        if os.path.abspath(root) in _full_roots:
            return None
        try:
            with _create_lock:
                os.makedirs(root, exist_ok=True)
                index = len(os.listdir(root))
                folder = os.path.join(root, folder_name(index, graph_name, current_compile_id()))
                os.makedirs(folder, exist_ok=True)
            return cls(folder)
        except OSError as exc:
            if not _disk_full(os.path.abspath(root), exc):
                log.warning("ascend_dsa: cannot create dump folder under %s (%s); compiling without a dump",
                            root, exc)
            return None

    def _write(self, filename: str, text: str) -> None:
        root = os.path.dirname(os.path.abspath(self.folder))
        if self.failed or root in _full_roots:
            return
        try:
            with open(os.path.join(self.folder, filename), "w") as f:
                f.write(text)
        except Exception as exc:  # a dump must never stop compilation
            self.failed = True
            if not (isinstance(exc, OSError) and _disk_full(root, exc)):
                log.warning("ascend_dsa: writing dump file %s failed (%s); dump stopped for this graph",
                            filename, exc)

    def _write_made(self, filename: str, make_text: Callable[[], str]) -> str | None:
        """Writes make_text(); returns the text, or None when making it failed (warned)."""
        try:
            text = make_text()
        except Exception as exc:  # a dump must never stop compilation
            log.warning("ascend_dsa: describing %s failed (%s)", filename, exc)
            return None
        self._write(filename, text)
        return text

    def write_stage(self, index: int, stage: str, gm: torch.fx.GraphModule, info: dict[str, Any],
                    changed: bool = True) -> None:
        """The stage's listing (.txt, reused from the stage before when the pass left the graph's code as it was)
        and its record with every node described (.json, one node per line)."""
        stem = f"{index:02d}_{stage}"
        if changed or self._listing is None:
            self._listing = self._write_made(stem + ".txt", lambda: graph_text(gm))
        else:
            self._write(stem + ".txt", self._listing)
        self._write_made(stem + ".json", lambda: stage_json({"stage": stage, **info}, describe_graph(gm)))

    def write_text(self, filename: str, text: str) -> None:
        self._write(filename, text)

    def write_summary(self, summary: dict[str, Any]) -> None:
        self._write_made("summary.json", lambda: json.dumps(summary, indent=2, default=str))


_COMMENT_LINE = re.compile(r"^[ \t]*# .*$\n?", re.MULTILINE)


_NUMBERED_NAME = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*?)_(\d+)\b")


def _code(source: str) -> str:
    """source without its comment lines ("# " at the start: Inductor's note of the FX node names each kernel
    came from changes with Dynamo's node counters; a C++ `#include` has no space and stays), and with every
    numbered name (`mul_166`, `slice_35`) renumbered by its first appearance: FX numbers a node after the nodes
    the process traced before, so the same graph traced in another process names its values otherwise."""
    numbers: dict[str, str] = {}

    def renumbered(match: re.Match[str]) -> str:
        return numbers.setdefault(match.group(0), f"{match.group(1)}_#{len(numbers)}")

    return _NUMBERED_NAME.sub(renumbered, _COMMENT_LINE.sub("", source))


def dump_matches_entry(report: GraphReport, recompiled: str, entry: str) -> None:
    """A cache hit's dump comes from compiling the graph again; summary.json says so and whether that gave the
    entry's code (comment lines aside). If not (a measured choice went the other way), the dump keeps both:
    compiled.py is the entry's code, which is what runs, and compiled_again.py the new one; one warning says so."""
    report.extra["dump_stages"] = "compiled again for this dump"
    same = _code(recompiled) == _code(entry)
    report.extra["dump_matches_entry"] = same
    if same or not report.dump_folder:
        return
    writer = GraphDump(report.dump_folder)
    writer.write_text("compiled.py", entry)
    writer.write_text("compiled_again.py", recompiled)
    log.warning("ascend_dsa: %s: compiling it again for its dump gave other code than its cache entry; the dump's "
                "stages are the new compile's, compiled.py is the entry's code (what runs)", report.name)

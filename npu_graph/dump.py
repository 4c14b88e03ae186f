"""Graph dumps: one folder per compiled graph under `dump_dir` (numbered in creation order within that folder),
a text and a JSON file per stage, the generated source and `summary.json`.

Dumping can never break compilation: every write error is logged once per graph and compilation goes on.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

log = logging.getLogger("npu_graph")

NODE_META_KEYS = ("created_by", "stream", "superkernel", "layout", "quant", "cost")

_create_lock = threading.Lock()


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


def graph_text(gm: torch.fx.GraphModule) -> str:
    """Readable listing of the graph with shapes and dtypes (what print_readable shows)."""
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


class GraphDump:
    """Writer for one graph's dump folder."""

    def __init__(self, folder: str):
        self.folder = folder
        self.failed = False

    @classmethod
    def create(cls, root: str, graph_name: str) -> GraphDump | None:
        try:
            with _create_lock:
                os.makedirs(root, exist_ok=True)
                index = len(os.listdir(root))
                folder = os.path.join(root, f"{index:03d}_{graph_name}_{os.getpid()}")
                os.makedirs(folder, exist_ok=True)
            return cls(folder)
        except OSError as exc:
            log.warning("ascend_dsa: cannot create dump folder under %s (%s); compiling without a dump",
                        root, exc)
            return None

    def _write(self, filename: str, text: str) -> None:
        if self.failed:
            return
        try:
            with open(os.path.join(self.folder, filename), "w") as f:
                f.write(text)
        except Exception as exc:  # a dump must never stop compilation
            self.failed = True
            log.warning("ascend_dsa: writing dump file %s failed (%s); dump stopped for this graph",
                        filename, exc)

    def _write_made(self, filename: str, make_text: Callable[[], str]) -> None:
        try:
            text = make_text()
        except Exception as exc:  # a dump must never stop compilation
            log.warning("ascend_dsa: describing %s failed (%s)", filename, exc)
            return
        self._write(filename, text)

    def write_stage(self, index: int, stage: str, gm: torch.fx.GraphModule, info: dict[str, Any]) -> None:
        stem = f"{index:02d}_{stage}"
        self._write_made(stem + ".txt", lambda: graph_text(gm))
        self._write_made(stem + ".json", lambda: json.dumps({"stage": stage, **info, "nodes": describe_graph(gm)},
                                                            indent=1, default=str))

    def write_text(self, filename: str, text: str) -> None:
        self._write(filename, text)

    def write_summary(self, summary: dict[str, Any]) -> None:
        self._write_made("summary.json", lambda: json.dumps(summary, indent=2, default=str))

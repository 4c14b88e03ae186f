"""Our pipeline stages in PyTorch's structured trace, so `TORCH_TRACE=dir` + tlparse users see them, and each
graph's generated code in the `ascend_dsa_code` log artifact (TORCH_LOGS=ascend_dsa_code, as Inductor's
`output_code`; the names are registered with torch's logging by npu_graph_torch_logs).

`traced_dump(dump, graph_name)` is called once by the compiler on the graph's dump writer. When no
structured trace is being written it returns `dump` unchanged (nothing else happens). Otherwise it returns a
`TracedDump` that emits every stage the pipeline writes as an `ascend_dsa_<stage>` artifact, then forwards
to the real dump when there is one. Tracing can never break compilation: every error is logged and dropped.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.fx
from torch._logging import trace_structured

import npu_graph_torch_logs
from npu_graph.observe.dump import GraphDump, graph_text

log = logging.getLogger("npu_graph")
npu_graph_torch_logs.register()  # so set_logs(modules={"ascend_dsa": ...}) knows our names in any process


@functools.cache
def code_logger() -> logging.Logger:
    """The `ascend_dsa_code` artifact logger."""
    return torch._logging.getArtifactLogger("npu_graph.compiled", npu_graph_torch_logs.CODE)


def log_code(graph_name: str, origin: str, source: str) -> None:
    """Log one graph's generated code to `ascend_dsa_code`; `origin` says where it came from."""
    logger = code_logger()
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("ascend_dsa: %s, %s, code:\n%s", graph_name, origin, source)


def tracing_enabled() -> bool:
    """True when a structured trace is being written (what `trace_structured` itself checks)."""
    try:
        return bool(torch._logging._internal.trace_log.handlers)
    except Exception:
        return False


def emit_artifact(name: str, payload: Any) -> None:
    """One string artifact `ascend_dsa_<name>`; `payload` is a callable returning the text."""
    try:
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"ascend_dsa_{name}", "encoding": "string"},
            payload_fn=payload,
        )
    except Exception as exc:  # tracing must never stop compilation
        log.debug("ascend_dsa: structured trace of %s failed (%s)", name, exc)


class TracedDump:
    """A dump writer that also emits each stage to the structured trace; `inner` may be None."""

    def __init__(self, inner: GraphDump | None, graph_name: str):
        self.inner = inner
        self.graph_name = graph_name

    @property
    def folder(self) -> str | None:
        return self.inner.folder if self.inner else None

    def write_stage(self, index: int, stage: str, gm: torch.fx.GraphModule, info: dict[str, Any],
                    changed: bool = True) -> None:
        emit_artifact(stage, lambda: f"# {self.graph_name}, stage {index}: {stage}\n{graph_text(gm)}")
        if self.inner:
            self.inner.write_stage(index, stage, gm, info, changed)

    def write_text(self, filename: str, text: str) -> None:
        emit_artifact(filename.replace(".", "_"), lambda: text)
        if self.inner:
            self.inner.write_text(filename, text)

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.inner:
            self.inner.write_summary(summary)


def traced_dump(dump: GraphDump | None, graph_name: str) -> GraphDump | TracedDump | None:
    """`dump` itself when no structured trace is on, else a TracedDump around it."""
    return TracedDump(dump, graph_name) if tracing_enabled() else dump

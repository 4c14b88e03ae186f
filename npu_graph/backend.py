"""The `ascend_dsa` torch.compile backend.

`torch.compile(model, backend="ascend_dsa", options={...})` reaches `ascend_dsa` through the
`torch_dynamo_backends` entry point. `get_backend(config)` returns one Backend per distinct config, so a
second torch.compile with the same backend object reuses Dynamo's compiled code.

If compiling a graph fails, the graph runs eagerly and one warning names the failing step (with
strict=True the error is raised instead).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx

from npu_graph.capture import capture_and_compile
from npu_graph.compiler import CompileStepError, compile_graph
from npu_graph.config import CompilerConfig
from npu_graph.report import GraphReport
from npu_graph.verify import verified

log = logging.getLogger("npu_graph")


class CompilationFallbackWarning(UserWarning):
    """A graph could not be compiled and runs eagerly instead."""


class Backend:
    """A Dynamo backend bound to one CompilerConfig; keeps a report per compiled graph."""

    def __init__(self, config: CompilerConfig):
        self.config = config
        self.reports: list[GraphReport] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ascend_dsa.Backend(target={self.config.target!r}, graphs={len(self.reports)})"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **_: Any
                 ) -> Callable[..., Any]:
        with self._lock:
            name = f"graph_{next(self._ids)}"
        start = time.perf_counter()
        try:
            compiled = capture_and_compile(gm, example_inputs, self._graph_compiler(name),
                                           self.config.experimental_config.keep_inference_input_mutations)
        except Exception as exc:
            return self._fall_back(gm, name, exc)
        log.info("ascend_dsa: compiled %s in %.1f ms", name, (time.perf_counter() - start) * 1e3)
        if self.config.verify.enabled:
            v = self.config.verify
            return verified(name, gm.forward, compiled, v.atol, v.rtol, self.config.strict)
        return compiled

    def _graph_compiler(self, name: str) -> Callable[..., Any]:
        parts = itertools.count()

        def compile_one(gm: torch.fx.GraphModule, inputs: Sequence[Any], inference: bool) -> Any:
            part = next(parts)
            suffix = "" if inference and part == 0 else f"_{'inference' if inference else 'autograd'}{part}"
            report = GraphReport(name=name + suffix, inference=inference, target=self.config.target)
            if not self.config.cache.enabled:
                report.cache_reason = "cache disabled"
            else:
                report.cache_reason = "no cache entry format yet"
            compiled = compile_graph(gm, inputs, self.config, report)
            with self._lock:
                self.reports.append(report)
            return compiled

        return compile_one

    def _fall_back(self, gm: torch.fx.GraphModule, name: str, exc: Exception) -> Callable[..., Any]:
        step = exc.step if isinstance(exc, CompileStepError) else "capture"
        if self.config.strict:
            raise exc
        message = (f"ascend_dsa: compiling {name} failed in step '{step}' ({type(exc).__name__}: {exc}); "
                   f"this graph runs eagerly. Set options={{'strict': True}} to raise instead.")
        warnings.warn(message, CompilationFallbackWarning, stacklevel=2)
        with self._lock:
            self.reports.append(GraphReport(name=name, inference=not torch.is_grad_enabled(),
                                            target=self.config.target, fallback=step))
        return gm.forward


_BACKENDS: dict[str, Backend] = {}
_BACKENDS_LOCK = threading.Lock()


def get_backend(config: CompilerConfig | dict[str, Any] | None = None) -> Backend:
    """The Backend for this config (a dict of options is accepted); equal configs share one object."""
    if not isinstance(config, CompilerConfig):
        config = CompilerConfig.from_options(config)
    key = config.key()
    with _BACKENDS_LOCK:
        if key not in _BACKENDS:
            _BACKENDS[key] = Backend(config)
        return _BACKENDS[key]


def ascend_dsa(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
               options: dict[str, Any] | None = None, **_: Any) -> Callable[..., Any]:
    """Dynamo entry point (`backend="ascend_dsa"`)."""
    return get_backend(CompilerConfig.from_options(options))(gm, example_inputs)

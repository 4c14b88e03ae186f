"""ascend_dsa behind vLLM's compiler interfaces.

AscendDsaCompiler is the CompilerInterface vLLM's piecewise mode hands each piece of the model to (between its
attention ops). A piece is compiled by the ascend_dsa Backend with its cache folder under vLLM's (vLLM's folder is
named by its hash of the config and the model, so both are part of where our entries live); the handle vLLM keeps
is the entry's key, and `load` serves the piece from that entry without capture, passes or lowering. Every compile
and load is appended to `compile_log.jsonl` in that folder (what a benchmark reads: graphs compiled, seconds).

`whole_graph` is the torch.compile backend for vLLM's whole-graph modes, with the same cache placement.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx
from vllm.compilation.compiler_interface import CompilerInterface

from npu_graph.backend import Backend, get_backend
from npu_graph.cache.key import source_digest, versions
from npu_graph.cache.precompiled import PrecompiledGraph

LOG_NAME = "compile_log.jsonl"


def _log(folder: str | None, event: str, seconds: float, graph: str, cache: str = "",
         fused_ops: dict[str, int] | None = None) -> None:
    if folder is None:
        return
    os.makedirs(folder, exist_ok=True)
    record = {"event": event, "seconds": seconds, "graph": graph, "cache": cache, "pid": os.getpid(),
              "fused_ops": fused_ops or {}}
    with open(os.path.join(folder, LOG_NAME), "a") as f:
        f.write(json.dumps(record) + "\n")


def _backend_for(folder: str | None) -> Backend:
    return get_backend({"cache_dir": folder} if folder else {"cache": False})


class AscendDsaCompiler(CompilerInterface):
    """vLLM's CompilerInterface for ascend_dsa (see the module docstring)."""

    name = "ascend_dsa"

    def __init__(self) -> None:
        self.folder: str | None = None

    def initialize_cache(self, cache_dir: str, disable_cache: bool = False, prefix: str = "") -> None:
        self.folder = None if disable_cache else os.path.join(cache_dir, "ascend_dsa")

    def compute_hash(self, vllm_config: Any) -> str:
        material = json.dumps([versions(), source_digest(), _backend_for(None).config.key()], sort_keys=True)
        return hashlib.sha256(material.encode()).hexdigest()[:10]

    def compile(self, graph: torch.fx.GraphModule, example_inputs: list[Any], compiler_config: dict[str, Any],
                compile_range: Any, key: str | None = None) -> tuple[Callable[..., Any] | None, Any | None]:
        start = time.perf_counter()
        backend = _backend_for(self.folder)
        compiled = backend(graph, example_inputs)
        if not isinstance(compiled, PrecompiledGraph):      # the graph fell back to eager (one warning said why)
            return compiled, None
        _log(self.folder, "compile", time.perf_counter() - start, compiled.name, compiled.key or "",
             _fused_ops(backend))
        return compiled, ((compiled.key, compiled.name) if compiled.key and self.folder else None)

    def load(self, handle: Any, graph: torch.fx.GraphModule, example_inputs: list[Any], graph_index: int,
             compile_range: Any) -> Callable[..., Any]:
        start = time.perf_counter()
        key, name = handle
        found = _backend_for(self.folder).cache.load_entry(key, name)
        if found is None:       # the entry went away (pruned, cleared): compile the piece again
            return self.compile(graph, example_inputs, {}, compile_range)[0]
        _log(self.folder, "load", time.perf_counter() - start, name, key)
        return PrecompiledGraph(found.callable, name, found.artifact, key=key)


def _vllm_folder() -> str | None:
    """Our cache folder for the whole-graph modes: under vLLM's cache root, named by vLLM's hash of its config and
    model; None when vLLM's compile cache is off."""
    import vllm.envs as envs
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if envs.VLLM_DISABLE_COMPILE_CACHE or config is None:
        return None
    return os.path.join(envs.VLLM_CACHE_ROOT, "torch_compile_cache", "ascend_dsa", config.compute_hash()[:10])


def whole_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """The torch.compile backend vLLM's whole-graph modes resolve (by this qualified name) for ascend_dsa."""
    folder = _vllm_folder()
    start = time.perf_counter()
    backend = _backend_for(folder)
    compiled = backend(gm, example_inputs)
    if isinstance(compiled, PrecompiledGraph):
        _log(folder, "compile", time.perf_counter() - start, compiled.name, compiled.key or "", _fused_ops(backend))
    return compiled


def _fused_ops(backend: Backend) -> dict[str, int]:
    """The fused ops in the graph the backend compiled last (its report)."""
    return dict(backend.reports[-1].fused_ops) if backend.reports else {}

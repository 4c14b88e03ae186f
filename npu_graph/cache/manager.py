"""The compile cache as the backend uses it: key before capture, hit -> load (no capture, passes or
lowering), miss -> compile under the entry's lock and store. Anything the cache cannot do safely is a bypass
with a reason, and a cache problem (an untrusted tree, a damaged entry, a read-only mount) never costs the
compiled graph: it gives one warning and the graph is compiled."""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx

from npu_graph.cache.disk_store import CacheWarning, DiskCache
from npu_graph.cache.entry import (
    Artifact,
    check_globals,
    check_runtime_metadata,
    constant_tensors,
    guards_hold,
)
from npu_graph.cache.key import Uncacheable, cache_key, key_material, symbolic_inputs, versions
from npu_graph.config import CompilerConfig
from npu_graph.runtime.compiled_graph import CompiledGraph
from npu_graph.runtime.size_guards import symbol_sources, unlocated


def needs_autograd(example_inputs: list[Any]) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


def _shape_env(example_inputs: list[Any]) -> Any:
    fake_mode = torch._guards.detect_fake_mode(list(example_inputs))
    return getattr(fake_mode, "shape_env", None)


def _attribute(gm: torch.nn.Module, fqn: str) -> Any:
    owner: Any = gm
    for part in fqn.split("."):
        owner = getattr(owner, part)
    return owner


@dataclass
class Lookup:
    """The cache's decision for one graph: a loaded callable (hit), or what to do after compiling."""

    decision: str
    reason: str = ""
    key: str | None = None
    callable: Callable[..., Any] | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    guard_count: int = 0
    source: str = ""  # a hit's generated code
    artifact: Artifact | None = None  # a hit's artifact (what a precompiled program serializes)

    def provenance(self, compile_id: str | None) -> dict[str, Any]:
        """What summary.json says about where a graph came from: "source" ("cache": loaded from the entry
        `cache_key`; "compiled": compiled by this process, then stored under `cache_key` when it is not None)."""
        return {"source": "cache" if self.decision == "hit" else "compiled", "cache_key": self.key,
                "compile_id": compile_id}


class CompileCache:
    """Binds a DiskCache to one backend config."""

    def __init__(self, config: CompilerConfig):
        self.config = config
        self.disk = DiskCache(config.cache.dir, config.cache.max_size) if config.cache.enabled else None
        if self.disk is not None and self.disk.refused:
            warnings.warn(f"ascend_dsa cache: {self.disk.refused}; compiling without the cache", CacheWarning,
                          stacklevel=2)

    def bypass_reason(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> str | None:
        if self.disk is None:
            return "cache disabled"
        if self.disk.refused:
            return self.disk.refused
        if needs_autograd(example_inputs):
            return "graph needs autograd"
        return None

    @contextlib.contextmanager
    def lookup(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Iterator[Lookup]:
        """Yields the decision. A hit needs no lock (entries are renamed into place whole), so a read-only cache
        serves it; on a miss the entry's lock is held until the caller has stored, and the entry is looked up
        again under it, in case another process stored it meanwhile."""
        reason = self.bypass_reason(gm, example_inputs)
        key = None
        if reason is None:
            try:
                key = cache_key(key_material(gm, example_inputs, self.config, inference=True))
            except Uncacheable as exc:
                reason = str(exc)
        if key is None:
            self._record("bypass", reason)
            yield Lookup("bypass", reason)
            return
        found = self._load(key, gm, example_inputs)
        if found.decision == "hit":
            yield found
            return
        with self.disk.lock(key):
            yield self._load(key, gm, example_inputs)

    def _load(self, key: str, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Lookup:
        shape_env = _shape_env(example_inputs)
        miss = Lookup("miss", "no entry", key, guard_count=len(shape_env.guards) if shape_env else 0)
        loaded = self.disk.load(key)
        if loaded is None:
            return miss
        artifact, meta = loaded
        try:
            if not guards_hold(artifact, symbolic_inputs(gm, example_inputs), shape_env):
                miss.reason = "stored guards do not hold"
                return miss
            params = [_attribute(gm, fqn) for fqn in artifact.param_fqns]
            graph = artifact.load(f"cached_{key[:12]}")
        except Exception as exc:  # a verified entry this process cannot load: recompile rather than run eagerly
            self.disk.reject(key, f"it cannot be loaded ({type(exc).__name__}: {exc})")
            miss.reason = "entry cannot be loaded"
            return miss

        def run(*args: Any) -> Any:
            return graph([*params, *args])

        self._record("hit")
        return Lookup("hit", "", key, run, meta.get("summary", {}), source=artifact.source, artifact=artifact)

    def load_entry(self, key: str, name: str | None = None) -> Lookup | None:
        """Entry `key` by its key alone, without its stored shape guards, its graph named `name`: for a graph that
        Dynamo's own guards matched (a shared trace: its guards hold every size guard of the compile), or a caller
        that keeps its own record of which entry serves which shapes (vLLM's compile cache). None when it is
        missing, cannot be loaded (then it is quarantined, as on a lookup), or reads attributes of Dynamo's graph
        module."""
        if self.disk is None or self.disk.refused:
            return None
        loaded = self.disk.load(key)
        if loaded is None or loaded[0].param_fqns:
            return None
        artifact, meta = loaded
        try:
            graph = artifact.load(name or f"cached_{key[:12]}")
        except Exception as exc:
            self.disk.reject(key, f"it cannot be loaded ({type(exc).__name__}: {exc})")
            return None
        self._record("hit")
        return Lookup("hit", "", key, lambda *args: graph(list(args)), meta.get("summary", {}), source=artifact.source,
                      artifact=artifact)

    def store(self, lookup: Lookup, example_inputs: list[Any], artifact: Artifact | None, summary: dict[str, Any],
              reason: str, replace: bool = False) -> str:
        """Store a freshly compiled miss, or with `replace` the same graph's code that runs from now on in place of
        what was stored; returns the final cache decision ("miss" or "bypass")."""
        if artifact is None:
            self._record("bypass", reason)
            return "bypass"
        artifact = dataclasses.replace(artifact, summary=summary)
        meta = {"versions": versions(), "config": self.config.to_dict(), "inputs": len(example_inputs)}
        size = self.disk.store(lookup.key, artifact, meta, replace=replace)
        if not replace:
            self._record("miss")
        if size:
            self._record("store", nbytes=size)
            self.disk.prune()
        return "miss"

    def _record(self, event: str, reason: str | None = None, nbytes: int = 0) -> None:
        if self.disk is not None and not self.disk.refused:
            self.disk.record(event, reason, nbytes)


def make_artifact(gm: torch.fx.GraphModule, example_inputs: list[Any], compiled: CompiledGraph,
                  guard_start: int) -> Artifact:
    """What to store for a compiled inference graph; raises Uncacheable when it cannot be stored safely."""
    check_runtime_metadata()
    shape_env = _shape_env(example_inputs)
    guards = [str(g.expr) for g in shape_env.guards[guard_start:]] if shape_env else []
    symbols = symbol_sources(symbolic_inputs(gm, example_inputs))
    _check_located(guards, symbols)
    fqns = [n for n, _ in gm.named_parameters(remove_duplicate=False)]
    fqns += [n for n, _ in gm.named_buffers(remove_duplicate=False)]
    return Artifact(compiled.source, check_globals(compiled.globals_), constant_tensors(compiled.attributes),
                    fqns, guards, symbols, prologue_params=list(compiled.param_indices))


def _check_located(guards: list[str], symbols: dict[str, list[Any]]) -> None:
    """Raise Uncacheable when a guard reads a size that none of the graph's inputs carries (`symbols`)."""
    for text in guards:
        unknown = unlocated([sympy.sympify(text)], symbols)
        if unknown:
            raise Uncacheable(f"guard {text} uses sizes the cache cannot locate: {unknown}")


def with_code(artifact: Artifact, source: str, globals_: dict[str, Any], attributes: dict[str, Any],
              guards: list[str]) -> Artifact:
    """`artifact` holding other code for the same graph, which needs `guards` too (its background glue compile
    landed: runtime.glue_upgrade); raises Uncacheable as make_artifact does."""
    _check_located(guards, artifact.symbols)
    return dataclasses.replace(artifact, source=source, global_names=check_globals(globals_),
                               constants=constant_tensors(attributes), guards=[*artifact.guards, *guards])

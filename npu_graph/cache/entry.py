"""A cache entry's contents: what a compiled inference graph needs to run again in another process.

The artifact is generated Python source, the names of the few module-level objects that source uses
(rebuilt from an allowlist on load, never unpickled), tensor constants (safetensors), the FQNs of module
parameters AOT lifted in front of the inputs, and the guards on symbolic sizes that capture and the passes
added. No arbitrary pickles: a graph needing anything else is Uncacheable. `artifact_files`, `artifact_record`
and `artifact_from` turn an artifact into an entry's files and meta.json section and back (the entry folder
itself, its checks and its tag: npu_graph.cache.folder).
"""
from __future__ import annotations

import builtins
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import sympy
import torch
import torch.fx

from npu_graph.cache.folder import CorruptEntry
from npu_graph.cache.key import Uncacheable
from npu_graph.runtime import streams, view_chains
from npu_graph.runtime.compiled_graph import CompiledGraph
from npu_graph.runtime.size_guards import size_at

SAFE_GLOBALS: dict[str, Any] = {
    "torch": torch, "inf": math.inf, "nan": math.nan, "math": math, "operator": operator,
    "_operator": operator, "builtins": builtins, "device": torch.device, "NoneType": type(None),
    "fx_pytree": torch.fx._pytree, "pytree": torch.utils._pytree,
    **{f"npu_graph_streams_{fn.__name__}": fn for fn in streams.EVENT_OPS},
    "torch__C__dynamo_guards__reinterpret_tensor": view_chains.reinterpret_tensor,
}
_SAFE_OUTPUT_TYPES = {"non_alias", "alias_of_input", "is_input"}


@dataclass
class Artifact:
    source: str
    global_names: list[str]
    constants: dict[str, torch.Tensor]
    param_fqns: list[str]
    guards: list[str]
    symbols: dict[str, list[Any]]
    summary: dict[str, Any] = field(default_factory=dict)
    prologue_params: list[int] = field(default_factory=list)

    def load(self, name: str) -> CompiledGraph:
        globals_ = {n: SAFE_GLOBALS[n] for n in self.global_names}
        return CompiledGraph(name, self.source, globals_, dict(self.constants), tuple(self.prologue_params))


def artifact_files(artifact: Artifact) -> dict[str, bytes]:
    """The entry files that hold an artifact: its source, and its tensor constants when it has any."""
    files = {"compiled.py": artifact.source.encode()}
    if artifact.constants:
        files["constants.safetensors"] = safetensors.torch.save(artifact.constants)
    return files


def artifact_record(artifact: Artifact) -> dict[str, Any]:
    """The rest of the artifact, as meta.json stores it."""
    return {"global_names": artifact.global_names, "param_fqns": artifact.param_fqns, "guards": artifact.guards,
            "symbols": artifact.symbols, "prologue_params": artifact.prologue_params}


def artifact_from(meta: dict[str, Any], files: dict[str, bytes]) -> Artifact:
    """The artifact of a verified entry (meta.json and its files); raises CorruptEntry when they make none."""
    try:
        record = meta["artifact"]
        constants = safetensors.torch.load(files["constants.safetensors"]) if "constants.safetensors" in files else {}
        artifact = Artifact(files["compiled.py"].decode(), list(record["global_names"]), constants,
                            record["param_fqns"], record["guards"], record["symbols"], meta.get("summary", {}),
                            record.get("prologue_params", []))
    except Exception as exc:  # a damaged safetensors blob raises the library's own errors
        raise CorruptEntry(f"{type(exc).__name__}: {exc}") from exc
    unknown = [name for name in artifact.global_names if name not in SAFE_GLOBALS]
    if unknown:
        raise CorruptEntry(f"the entry names globals that are not on the allowlist: {unknown}")
    return artifact


def check_globals(globals_: dict[str, Any]) -> list[str]:
    """Names of the generated source's globals, if every one is on the allowlist."""
    names = []
    for name, value in globals_.items():
        if name == "__builtins__":
            continue
        if SAFE_GLOBALS.get(name) is not value:
            raise Uncacheable(f"generated source uses {name!r}, which the cache cannot rebuild")
        names.append(name)
    return sorted(names)


def check_runtime_metadata() -> None:
    """Refuse graphs whose AOT runtime wrappers do work beyond calling the graph."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is None:
        raise Uncacheable("AOT metadata unavailable")
    if meta.tokens or meta.num_intermediate_bases:
        raise Uncacheable("graph has side-effect tokens or aliased intermediate outputs")
    if any(i.mutation_type.name == "MUTATED_OUT_GRAPH" for i in meta.input_info):
        raise Uncacheable("graph mutates input metadata outside the graph")
    if any(o.output_type.name not in _SAFE_OUTPUT_TYPES for o in meta.output_info):
        raise Uncacheable("graph returns views of intermediates")


def constant_tensors(attributes: dict[str, Any]) -> dict[str, torch.Tensor]:
    bad = [name for name, value in attributes.items() if not isinstance(value, torch.Tensor)]
    if bad:
        raise Uncacheable(f"graph reads non-tensor attributes {bad}")
    return {name: value.detach().contiguous() for name, value in attributes.items()}


def _current_symbols(symbols: dict[str, list[Any]], example_inputs: list[Any]) -> dict[str, Any]:
    current = {}
    for name, where in symbols.items():
        value = size_at(where, example_inputs)
        current[name] = value.node.expr if isinstance(value, torch.SymInt) else sympy.Integer(value)
    return current


def guards_hold(artifact: Artifact, example_inputs: list[Any], shape_env: Any) -> bool:
    """True when every stored guard holds for these inputs; then they are installed into Dynamo's
    ShapeEnv so a later call that breaks one recompiles."""
    if not artifact.guards:
        return True
    if shape_env is None:
        return False
    current = _current_symbols(artifact.symbols, example_inputs)
    exprs = []
    for text in artifact.guards:
        expr = sympy.sympify(text)
        expr = expr.xreplace({s: current[s.name] for s in expr.free_symbols})
        hinted = expr.xreplace(shape_env.backed_var_to_val)
        if hinted != sympy.true:
            return False
        exprs.append(expr)
    for expr in exprs:
        shape_env.evaluate_expr(expr)
    return True

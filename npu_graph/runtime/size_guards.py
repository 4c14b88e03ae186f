"""Size guards of a graph checked where Dynamo does not check them.

A graph's symbolic sizes are symbols of Dynamo's ShapeEnv (s0, s6, ...), each read from one input: a SymInt input
or a dimension of an input tensor (`symbol_sources`). Guards that code needs beyond Dynamo's — a cache entry's
(npu_graph.cache.entry), or those Inductor added compiling a graph's glue after Dynamo had installed its guards
(npu_graph.runtime.glue_upgrade) — are sympy relations over those symbols; `guard_check` turns them into one
Python predicate over the graph's inputs, so the code that needs them runs only where they hold.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sympy
import torch


def symbol_sources(values: list[Any]) -> dict[str, list[Any]]:
    """Where each size symbol of these input values comes from: ["size", input, dim] or ["symint", input]."""
    sources: dict[str, list[Any]] = {}
    for i, value in enumerate(values):
        if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
            sources.setdefault(str(value.node.expr), ["symint", i])
        elif isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    sources.setdefault(str(size.node.expr), ["size", i, d])
    return sources


def size_at(where: list[Any], inputs: list[Any]) -> Any:
    """The size a symbol's source (`symbol_sources`) reads from these inputs: an int, or a SymInt while tracing."""
    return inputs[where[1]] if where[0] == "symint" else inputs[where[1]].shape[where[2]]


def unlocated(exprs: list[sympy.Expr], sources: dict[str, list[Any]]) -> list[str]:
    """The sizes these guards read that no input carries (not in `sources`, symbol_sources' result), sorted."""
    return sorted({s.name for e in exprs for s in e.free_symbols} - set(sources))


def guard_check(guards: list[str], sources: dict[str, list[Any]]) -> Callable[[list[Any]], bool]:
    """One predicate over a graph's inputs that is True where every guard holds. Raises ValueError when a guard
    reads a size no input carries or uses a function plain Python cannot evaluate."""
    exprs = [sympy.sympify(text) for text in guards]
    missing = unlocated(exprs, sources)
    if missing:
        raise ValueError(f"the guards read sizes no input carries: {missing}")
    names = sorted({s.name for e in exprs for s in e.free_symbols})
    undefined = [str(f) for e in exprs for f in e.atoms(sympy.core.function.AppliedUndef)]
    if undefined:
        raise ValueError(f"the guards use functions plain Python cannot evaluate: {undefined}")
    symbols = [sympy.Symbol(n) for n in names]
    check = sympy.lambdify(symbols, sympy.And(*exprs), modules="math")
    places = [sources[n] for n in names]
    return lambda inputs: bool(check(*(size_at(where, inputs) for where in places)))

"""SuperKernel regions: runs of graph nodes launched as one callable submodule `superkernel_N`.

Nodes tagged node.meta["superkernel"] = N that follow each other in the graph become one call_module node
whose target is the submodule `superkernel_N` (a GraphModule over the run; the nodes inside keep their
meta). `wrap` builds those submodules, `inline` puts their nodes back (the CPU target does that to hoist
parameter-only work out of regions, then wraps again), and `region_source` turns each submodule into a
function `superkernel_N(self, ...)` of the generated source, which the runtime binds (npu_graph.runtime.compiled_graph).
"""
from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx

from npu_graph.pass_api import MetaKey
from npu_graph.runtime.autotune import MeasuredChoice

PREFIX = "superkernel_"


def _runs(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    runs: list[list[torch.fx.Node]] = []
    previous = None
    for node in graph.nodes:
        tag = node.meta.get(MetaKey.SUPERKERNEL) if node.op == "call_function" else None
        if tag is None:
            previous = None
            continue
        if tag != previous:
            runs.append([])
        runs[-1].append(node)
        previous = tag
    return runs


def _region_graph(run: list[torch.fx.Node]) -> tuple[torch.fx.Graph, list[torch.fx.Node], list[torch.fx.Node]]:
    """The run as its own graph; returns it, the outside values it reads, and the members read outside."""
    members = set(run)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs: list[torch.fx.Node] = []
    for node in run:
        for arg in node.all_input_nodes:
            if arg not in members and arg not in env:
                env[arg] = graph.placeholder(arg.name)
                env[arg].meta = dict(arg.meta)
                inputs.append(arg)
        env[node] = graph.node_copy(node, env.__getitem__)
    outputs = [n for n in run if any(user not in members for user in n.users)]
    graph.output(tuple(env[n] for n in outputs))
    return graph, inputs, outputs


def wrap(gm: torch.fx.GraphModule) -> int:
    """Replace every run of nodes sharing a meta["superkernel"] tag by a call to submodule `superkernel_N`.
    Returns the number of regions."""
    runs = _runs(gm.graph)
    for run in runs:
        index = run[0].meta[MetaKey.SUPERKERNEL]
        graph, inputs, outputs = _region_graph(run)
        name = f"{PREFIX}{index}"
        gm.add_submodule(name, torch.fx.GraphModule(torch.nn.Module(), graph, name))
        with gm.graph.inserting_after(run[-1]):
            call = gm.graph.call_module(name, tuple(inputs))
        call.meta.update({MetaKey.SUPERKERNEL: index, MetaKey.STREAM: run[0].meta.get(MetaKey.STREAM, 0),
                          "val": tuple(n.meta.get("val") for n in outputs)})
        with gm.graph.inserting_after(call):
            for i, node in enumerate(outputs):
                item = gm.graph.call_function(operator.getitem, (call, i))
                item.meta = {**node.meta, MetaKey.SUPERKERNEL: None}
                node.replace_all_uses_with(item, delete_user_cb=lambda user, members=set(run): user not in members)
        for node in reversed(run):
            gm.graph.erase_node(node)
    gm.recompile()
    return len(runs)


def inline(gm: torch.fx.GraphModule) -> None:
    """Put the nodes of every superkernel submodule back into the graph (they keep their tags)."""
    for call in [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith(PREFIX)]:
        sub = gm.get_submodule(call.target)
        env: dict[torch.fx.Node, Any] = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"],
                                                 call.args, strict=True))
        with gm.graph.inserting_before(call):
            for node in sub.graph.nodes:
                if node.op == "call_function":
                    env[node] = gm.graph.node_copy(node, env.__getitem__)
        results = [env[v] for v in sub.graph.output_node().args[0]]
        for item in list(call.users):
            item.replace_all_uses_with(results[item.args[1]])
            gm.graph.erase_node(item)
        gm.graph.erase_node(call)
        delattr(gm, call.target)
    gm.recompile()


def region_source(gm: torch.fx.GraphModule) -> tuple[str, dict[str, Any]]:
    """Source of one function `superkernel_N(self, *inputs)` per region of `gm`, and the globals it uses."""
    source, globals_ = "", {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target.startswith(PREFIX):
            code = gm.get_submodule(node.target).graph.python_code(root_module="self")
            source += code.src.replace("def forward(", f"def {node.target}(", 1)
            globals_.update(code.globals)
    return source, globals_


def is_region(node: torch.fx.Node) -> bool:
    return node.op == "call_module" and isinstance(node.target, str) and node.target.startswith(PREFIX)


def bind_regions(holder: Any, namespace: dict[str, Any], plain: dict[str, Any]) -> None:
    """Make every `superkernel_N` function of executed generated source callable as `holder.superkernel_N`.
    With SUPERKERNEL_COMPILER = "inductor" in the source, each region is compiled by Inductor on first use
    (from `plain`, the namespace of the source without the runtime's direct bindings, which Dynamo cannot
    trace); with "measured", its first call times the Python and Inductor forms and keeps the faster
    (npu_graph.runtime.autotune)."""
    compiler = namespace.get("SUPERKERNEL_COMPILER", "python")
    for name, fn in namespace.items():
        if name.startswith(PREFIX) and callable(fn):
            region = functools.partial(fn, holder)
            if compiler == "python":
                setattr(holder, name, region)
                continue
            inductor = torch.compile(functools.partial(plain[name], holder), backend="inductor", dynamic=None)
            if compiler == "measured":
                inductor = MeasuredChoice(name, {"python": region, "inductor": inductor},
                                          functools.partial(setattr, holder, name))
            setattr(holder, name, inductor)

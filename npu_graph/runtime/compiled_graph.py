"""CompiledGraph: what the backend hands back to AOT autograd for one graph.

It is generated Python source (a `forward(self, *inputs)` function, and optionally a `prologue` over the
parameters whose outputs forward takes as extra inputs, and one `superkernel_N` function per SuperKernel
region, bound as `self.superkernel_N`), the constants and submodules that source reads as `self.<name>`,
and the boxed calling convention (the input list is cleared so inputs can be freed as soon as the graph no
longer needs them). The source runs as it is: the CPU lowering bound its calls (npu_graph.targets.cpu_bindings),
and its header resolves them through the `_bind` this module puts in its namespace (npu_graph.runtime.direct_calls).

The prologue runs again whenever a parameter object or its version counter changes; with
`FROZEN_PARAMETERS = True` in the source (torchair's frozen_parameter) it runs once and calls check nothing.
Settings the source carries at its top: SUPERKERNEL_COMPILER (npu_graph.runtime.superkernel), FROZEN_PARAMETERS and
GLUE ('inductor' when the graph after the prologue is Inductor's generated module, npu_graph.runtime.inductor_glue).
"""
from __future__ import annotations

import operator
from types import SimpleNamespace
from typing import Any

from npu_graph.kernels import env_settings
from npu_graph.kernels.checks import shapes_checked_at_trace
from npu_graph.runtime import direct_calls, weight_arena
from npu_graph.runtime.profiling import ProfiledCalls
from npu_graph.runtime.superkernel import bind_regions


def _nested_namespace(attributes: dict[str, Any]) -> SimpleNamespace:
    """Holder object on which `self.a.b` resolves for the attribute path "a.b"."""
    root = SimpleNamespace()
    for path, value in attributes.items():
        *parents, leaf = path.split(".")
        node = root
        for part in parents:
            if not hasattr(node, part):
                setattr(node, part, SimpleNamespace())
            node = getattr(node, part)
        setattr(node, leaf, value)
    return root


_VERSION = operator.attrgetter("_version")


def _executed(source: str, globals_: dict[str, Any], name: str, binder: Any) -> dict[str, Any]:
    """The namespace of `source` run with its calls bound by `binder` (direct_calls)."""
    namespace = {**globals_, "_bind": binder}
    exec(compile(source, f"<ascend_dsa:{name}>", "exec"), namespace)
    return namespace


class CompiledGraph:
    """Generated source + constant plan, callable with AOT's boxed convention."""

    _boxed_call = True

    def __init__(self, name: str, source: str, globals_: dict[str, Any], attributes: dict[str, Any],
                 param_indices: tuple[int, ...] = ()):
        self.name = name
        self.source = source
        self.attributes = attributes
        self.globals_ = globals_
        self.param_indices = param_indices
        namespace = _executed(source, globals_, name, direct_calls.DIRECT)
        self._profiled = ProfiledCalls(namespace, direct_calls.profiler_labels(namespace))
        self._forward = namespace["forward"]
        self._prologue = namespace.get("prologue")
        self._self = _nested_namespace(attributes)
        compiler = namespace.get("SUPERKERNEL_COMPILER", "python")
        traced = {} if compiler == "python" else _executed(source, globals_, name, direct_calls.AS_TRACED)
        bind_regions(self._self, namespace, traced)
        self.frozen_parameters = bool(namespace.get("FROZEN_PARAMETERS", False))
        self.glue = namespace.get("GLUE", "python")      # what runs the graph (npu_graph.targets.cpu.lower)
        self.glue_reason = ""
        self.prologue_runs = 0
        self.arena_bytes = 0        # prologue outputs moved into huge pages (npu_graph.runtime.weight_arena)
        self._hoisted: tuple[Any, ...] = ()
        self._hoisted_for: tuple[list[int], list[int]] | None = None

    def _hoisted_values(self, inputs: list[Any]) -> tuple[Any, ...]:
        """Prologue outputs, recomputed only when a parameter object or its version changes; with frozen
        parameters (FROZEN_PARAMETERS in the source) computed once, with no per-call check."""
        if self.frozen_parameters and self._hoisted_for is not None:
            return self._hoisted
        params = [inputs[i] for i in self.param_indices]
        stamp = (list(map(id, params)), list(map(_VERSION, params)))
        if stamp != self._hoisted_for:
            self._hoisted, self.arena_bytes = weight_arena.pack(tuple(self._prologue(self._self, *params)), inputs)
            self._hoisted_for = stamp
            self.prologue_runs += 1
        return self._hoisted

    def __call__(self, args: list[Any]) -> Any:
        inputs = list(args)
        args.clear()
        self._profiled.sync()
        with shapes_checked_at_trace(), env_settings.frozen():
            if self._prologue is None:
                return self._forward(self._self, *inputs)
            return self._forward(self._self, *inputs, *self._hoisted_values(inputs))

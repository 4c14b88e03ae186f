"""CompiledGraph: what the backend hands back to AOT autograd for one graph.

It is generated Python source (a `forward(self, *inputs)` function, and optionally a `prologue` over the
parameters whose outputs forward takes as extra inputs, and one `superkernel_N` function per SuperKernel
region, bound as `self.superkernel_N`), the constants and submodules that source reads as `self.<name>`,
and the boxed calling convention (the input list is cleared so inputs can be freed as soon as the graph no
longer needs them). When it is built, fused-op calls are bound to their Python implementations and ATen
calls to their C++ callables (direct_calls); before that, the ATen calls a native kernel takes where it applies
are bound to it: aten.mm for decode-sized operands (skinny_mm), depthwise 1-D convolutions (depthwise_conv1d)
and CPU flash attention with small head dims (dense_attention).

The prologue runs again whenever a parameter object or its version counter changes; with
`FROZEN_PARAMETERS = True` in the source (torchair's frozen_parameter) it runs once and calls check nothing.
Settings the source carries at its top: SUPERKERNEL_COMPILER (npu_graph.superkernel) and FROZEN_PARAMETERS.
"""
from __future__ import annotations

import operator
from types import SimpleNamespace
from typing import Any

from npu_graph.direct_calls import bind_aten_calls, bind_direct_calls, profiler_labels
from npu_graph.kernels import dense_attention, depthwise_conv1d, env_settings, skinny_mm
from npu_graph.kernels.checks import shapes_checked_at_trace
from npu_graph.profiling import ProfiledCalls
from npu_graph.superkernel import bind_regions


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


def _executed(source: str, globals_: dict[str, Any], name: str) -> dict[str, Any]:
    """The namespace of `source` run as it is (torch.ops calls, no direct bindings): what Inductor traces."""
    namespace = dict(globals_)
    exec(compile(source, f"<ascend_dsa:{name}:plain>", "exec"), namespace)
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
        runnable, namespace = bind_direct_calls(source)
        labels = profiler_labels(namespace)
        for bind in (skinny_mm.bind, depthwise_conv1d.bind, dense_attention.bind, bind_aten_calls):
            runnable, names = bind(runnable)
            namespace.update(names)
        namespace = {**globals_, **namespace}
        exec(compile(runnable, f"<ascend_dsa:{name}>", "exec"), namespace)
        self._profiled = ProfiledCalls(namespace, labels)
        self._forward = namespace["forward"]
        self._prologue = namespace.get("prologue")
        self._self = _nested_namespace(attributes)
        compiler = namespace.get("SUPERKERNEL_COMPILER", "python")
        bind_regions(self._self, namespace, {} if compiler == "python" else _executed(source, globals_, name))
        self.frozen_parameters = bool(namespace.get("FROZEN_PARAMETERS", False))
        self.prologue_runs = 0
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
            self._hoisted = tuple(self._prologue(self._self, *params))
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

"""CompiledGraph: what the backend hands back to AOT autograd for one graph.

It is generated Python source (a `forward(self, *inputs)` function, and optionally a `prologue` over the
parameters whose outputs forward takes as extra inputs, and one `superkernel_N` function per SuperKernel
region, bound as `self.superkernel_N`), the constants and submodules that source reads as `self.<name>`,
and the boxed calling convention (the input list is cleared so inputs can be freed as soon as the graph no
longer needs them). The source runs as it is: the CPU lowering bound its calls (npu_graph.targets.cpu_bindings),
and its header resolves them through the `_bind` this module puts in its namespace (npu_graph.runtime.direct_calls).

The prologue runs again whenever a parameter object, its version counter or its data's address changes (objects
are compared by weak reference, not by id: a parameter replaced by a new one at the freed one's address is a new
object; `p.data = t` keeps the object and the version but not the address). Writes through `p.data` in place
(`p.data.copy_(t)`) bump no version counter and are not seen, as autograd does not see them: update parameters
with `p.copy_(t)` under `torch.no_grad()`, as `load_state_dict` does. With
`FROZEN_PARAMETERS = True` in the source (torchair's frozen_parameter) it runs once and calls check nothing.
Settings the source carries at its top: SUPERKERNEL_COMPILER (npu_graph.runtime.superkernel), FROZEN_PARAMETERS and
GLUE ('inductor' when the graph after the prologue is Inductor's generated module, npu_graph.runtime.inductor_glue).
A graph handed back with a GlueUpgrade (npu_graph.runtime.glue_upgrade) runs its Python source until Inductor's,
compiled in the background, has landed, then that one — where its extra shape guards hold, if it has any.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from npu_graph.kernels.checks import shapes_checked_at_trace
from npu_graph.kernels.native import env_settings
from npu_graph.runtime import direct_calls, glue_upgrade, inductor_glue, weight_arena
from npu_graph.runtime.glue_upgrade import GlueUpgrade
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




def _executed(source: str, globals_: dict[str, Any], name: str, binder: Any) -> dict[str, Any]:
    """The namespace of `source` run with its calls bound by `binder` (direct_calls)."""
    namespace = {**globals_, "_bind": binder}
    exec(compile(source, f"<ascend_dsa:{name}>", "exec"), namespace)
    return namespace


def _stamp(param: Any) -> tuple[int, int]:
    """What says a parameter object's data changed: its version counter and its data's address."""
    return param._version, param.data_ptr()


class CompiledGraph:
    """Generated source + constant plan, callable with AOT's boxed convention."""

    _boxed_call = True

    def __init__(self, name: str, source: str, globals_: dict[str, Any], attributes: dict[str, Any],
                 param_indices: tuple[int, ...] = ()):
        self.name = name
        self.param_indices = param_indices
        self._load(source, globals_, attributes)
        self.glue_reason = ""
        self.glue_upgrade: GlueUpgrade | None = None     # Inductor's glue compiling in the background
        self.glue_calls_before = 0                        # calls its Python glue served until that landed
        self._glue_guard: Callable[[list[Any]], bool] | None = None    # where that glue may run (size_guards)
        self._outside_guard: tuple[Callable[..., Any], Any] = (self._forward, self._self)
        self.upgrade_listeners: list[Callable[[CompiledGraph], None]] = []
        self.prologue_runs = 0
        self.arena_bytes = 0        # prologue outputs moved into huge pages (npu_graph.runtime.weight_arena)
        self._hoisted: tuple[Any, ...] = ()
        self._hoisted_for: tuple[list[weakref.ref], list[tuple[int, int]]] | None = None

    def _load(self, source: str, globals_: dict[str, Any], attributes: dict[str, Any]) -> None:
        self.__dict__.update(self._prepared(source, globals_, attributes))

    def _prepared(self, source: str, globals_: dict[str, Any], attributes: dict[str, Any]) -> dict[str, Any]:
        """The attributes that running `source` gives this graph (its forward, prologue, regions, settings)."""
        if inductor_glue.is_inductor_glue(source):      # its module asks Inductor for the vector ISA list
            inductor_glue.vec_isa_checked()
        namespace = _executed(source, globals_, self.name, direct_calls.DIRECT)
        holder = _nested_namespace(attributes)
        compiler = namespace.get("SUPERKERNEL_COMPILER", "python")
        traced = {} if compiler == "python" else _executed(source, globals_, self.name, direct_calls.AS_TRACED)
        bind_regions(holder, namespace, traced)
        return {"source": source, "globals_": globals_, "attributes": attributes, "_self": holder,
                "_profiled": ProfiledCalls(namespace, direct_calls.profiler_labels(namespace)),
                "_forward": namespace["forward"], "_prologue": namespace.get("prologue"),
                "frozen_parameters": bool(namespace.get("FROZEN_PARAMETERS", False)),
                "glue": namespace.get("GLUE", "python")}    # what runs the graph (npu_graph.targets.cpu.lower)

    def attach_upgrade(self, upgrade: GlueUpgrade) -> None:
        """Run the Python glue until `upgrade`, Inductor's glue compiled in the background, lands."""
        upgrade.prepare = lambda built: self._prepared(*built)
        self.glue_upgrade = upgrade

    def _advance_upgrade(self, upgrade: GlueUpgrade) -> None:
        """Start the background glue compile at the graph's second call (a graph called once never needs it);
        switch to its result once it has finished (the worker's thread has run its source: the switch is an
        assignment)."""
        if not upgrade.started and upgrade.calls_before >= glue_upgrade.START_AFTER_CALLS:
            upgrade.start()
        if not upgrade.finished:
            upgrade.calls_before += 1
            return
        self.glue_upgrade = None
        self.glue_reason = upgrade.reason
        self.glue_calls_before = upgrade.calls_before
        if upgrade.ready is not None:
            if upgrade.guard is not None:     # Inductor's glue where its shape guards hold, this one elsewhere
                self._glue_guard, self._outside_guard = upgrade.guard, (self._forward, self._self)
            self.__dict__.update(upgrade.ready)
        for listener in self.upgrade_listeners:
            listener(self)

    def finish_glue(self) -> None:
        """Wait for a background glue compile (starting it if needed) and switch to its result."""
        if self.glue_upgrade is not None:
            self.glue_upgrade.wait()
            self._advance_upgrade(self.glue_upgrade)

    def _hoisted_values(self, inputs: list[Any]) -> tuple[Any, ...]:
        """Prologue outputs, recomputed only when a parameter object or its version changes; with frozen
        parameters (FROZEN_PARAMETERS in the source) computed once, with no per-call check."""
        if self.frozen_parameters and self._hoisted_for is not None:
            return self._hoisted
        params = [inputs[i] for i in self.param_indices]
        versions = list(map(_stamp, params))
        if not self._hoisted_from(params, versions):
            self._hoisted, self.arena_bytes = weight_arena.pack(tuple(self._prologue(self._self, *params)), inputs)
            self._hoisted_for = list(map(weakref.ref, params)), versions
            self.prologue_runs += 1
        return self._hoisted

    def _hoisted_from(self, params: list[Any], versions: list[tuple[int, int]]) -> bool:
        """Whether the prologue's outputs were made from these very parameter objects at these versions and data
        addresses."""
        if self._hoisted_for is None or versions != self._hoisted_for[1]:
            return False
        return all(ref() is param for ref, param in zip(self._hoisted_for[0], params))

    def __call__(self, args: list[Any]) -> Any:
        if self.glue_upgrade is not None:
            self._advance_upgrade(self.glue_upgrade)
        inputs = list(args)
        args.clear()
        self._profiled.sync()
        with shapes_checked_at_trace(), env_settings.frozen():
            if self._prologue is not None:
                inputs += self._hoisted_values(inputs)
            if self._glue_guard is not None and not self._glue_guard(inputs):
                forward, holder = self._outside_guard
                return forward(holder, *inputs)
            return self._forward(self._self, *inputs)

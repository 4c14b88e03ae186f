"""CompiledGraph: what the backend hands back to AOT autograd for one graph.

It is generated Python source (one `forward(self, *inputs)` function), the constants and submodules that
source reads as `self.<name>`, and the boxed calling convention (the input list is cleared so inputs can be
freed as soon as the graph no longer needs them).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any


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


class CompiledGraph:
    """Generated source + constant plan, callable with AOT's boxed convention."""

    _boxed_call = True

    def __init__(self, name: str, source: str, globals_: dict[str, Any], attributes: dict[str, Any]):
        self.name = name
        self.source = source
        self.attributes = attributes
        self.globals_ = globals_
        namespace = dict(globals_)
        exec(compile(source, f"<ascend_dsa:{name}>", "exec"), namespace)
        self._forward = namespace["forward"]
        self._self = _nested_namespace(attributes)

    def __call__(self, args: list[Any]) -> Any:
        inputs = list(args)
        args.clear()
        return self._forward(self._self, *inputs)

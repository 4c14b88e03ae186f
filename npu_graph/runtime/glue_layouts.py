"""The graph's output layouts kept when Inductor's module runs its glue (npu_graph.runtime.inductor_glue).

Inductor does not always give an output the strides eager gives it: its decomposition of `cat` drops empty inputs
and clones the one left, so transformers' DynamicCache, whose first update is `cat([empty, key_states], -2)` with
`key_states` a transposed view, gets the key cache laid out [B, T, H, D] under Inductor and contiguous under eager.
Inductor's own backend lives with that (Dynamo guards the next step on the strides Inductor gave). Our graphs
switch from their Python glue to Inductor's module while they run (npu_graph.runtime.glue_upgrade): the graphs
compiled meanwhile guard on the Python glue's strides, which are eager's, so a changed layout would fail those guards
and recompile every later graph (tiny llama: a fourth graph, and a generate() 0.72x Inductor's).

`outputs_to_relayout` compares the strides Inductor's module gives (its CompiledFxGraph's `output_strides`) with
the graph's (its output nodes' traced values): an output that differs and that the graph has contiguous is made
contiguous again by the module's adapter (a copy, only for that output); any other difference refuses Inductor's
module (GlueUnsupported), and the Python glue keeps running the graph.
"""
from __future__ import annotations

from collections.abc import Sequence

import sympy
import torch
import torch.fx


class LayoutMismatch(ValueError):
    """Inductor's module would give an output a layout the graph's other glue does not, and no copy mends it."""


def traced_output_layouts(gm: torch.fx.GraphModule) -> list[tuple[object, ...] | None]:
    """Each output's (sizes, strides) as the graph traced them (None for a non-tensor output)."""
    (output,) = gm.graph.find_nodes(op="output")
    args = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    layouts: list[tuple[object, ...] | None] = []
    for arg in args:
        value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        layouts.append((tuple(value.shape), value.stride()) if isinstance(value, torch.Tensor) else None)
    return layouts


def _expr(value: object) -> sympy.Expr:
    """A size or stride (int, SymInt, sympy expression or Inductor's expression string) as a sympy expression whose
    symbols are plain names (the shape environment's carry assumptions that a name read back from text lacks)."""
    if isinstance(value, torch.SymInt):
        value = value.node.expr
    return sympy.sympify(str(value))


def _same(a: Sequence[object], b: Sequence[object]) -> bool:
    return len(a) == len(b) and all(sympy.expand(_expr(x) - _expr(y)) == 0 for x, y in zip(a, b))


def _contiguous_strides(sizes: Sequence[object]) -> list[sympy.Expr]:
    """torch's contiguous strides for `sizes` (a symbolic size counts as at least 1, as a traced one is)."""
    strides, step = [], sympy.Integer(1)
    for size in reversed(sizes):
        strides.append(step)
        step = step * (max(size, 1) if isinstance(size, int) else _expr(size))
    return strides[::-1]


def outputs_to_relayout(traced: list[tuple[object, ...] | None], given: list[tuple[str, ...] | None] | None,
                        kinds: list[str]) -> tuple[int, ...]:
    """Indices of the outputs the adapter makes contiguous: those whose strides Inductor's module (`given`) gives
    unlike the graph (`traced`), where the graph has them contiguous and the output is no alias (`kinds`: AOT
    autograd's output types). Raises LayoutMismatch for any other difference."""
    if given is None or len(given) != len(traced):
        raise LayoutMismatch("Inductor reported no layout for the graph's outputs")
    relayout = []
    for index, (layout, strides) in enumerate(zip(traced, given)):
        if layout is None or strides is None or _same(layout[1], strides):
            continue
        sizes, wanted = layout
        if not _same(wanted, _contiguous_strides(sizes)) or kinds[index] != "non_alias":
            raise LayoutMismatch(f"output {index} would have strides {tuple(strides)} under Inductor's module, "
                                 f"{tuple(wanted)} under the graph's Python glue")
        relayout.append(index)
    return tuple(relayout)


def adapter(relayout: tuple[int, ...]) -> str:
    """The `forward(self, *inputs)` that ends the module: Inductor's boxed `call`, the `relayout` outputs made
    contiguous."""
    if not relayout:
        return '''

def forward(self, *inputs):
    """The CPU runtime's calling convention over Inductor's boxed `call`."""
    return tuple(call(list(inputs)))
'''
    return f'''

def forward(self, *inputs):
    """The CPU runtime's calling convention over Inductor's boxed `call`; outputs {list(relayout)} made contiguous,
    as the graph lays them out (npu_graph.runtime.glue_layouts)."""
    outputs = list(call(list(inputs)))
    for index in {relayout!r}:
        outputs[index] = outputs[index].clone(memory_format=torch.contiguous_format)
    return tuple(outputs)
'''

"""Capture: Dynamo's graph -> AOT autograd's functional ATen graph with fake tensors in node.meta["val"].

Inference graphs (no gradient needed) go to `compile_graph(..., inference=True)` and get every pass;
graphs that need autograd are split by AOT into forward and backward, and each is compiled with
inference-only passes skipped. Symbolic sizes from Dynamo stay symbolic (placeholders of SymInt).

Python floats that Dynamo made graph inputs (dynamic=True: a module's `eps` becomes a 0-dim tensor) are listed by
`float_inputs`; a pass that needs one as a number asks Dynamo to trace again with it a constant (guarded by
Dynamo, as every constant is: PassContext.ask_constant raises Dynamo's own restart), and `restart_request` finds
that request under the errors that wrap it on the way out of the backend.
AOT autograd's cache is kept off for the capture: the backend keys and stores its own compiled graphs.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch._functorch.config
import torch.fx
from torch._dynamo.exc import TensorifyScalarRestartAnalysis
from torch._functorch.aot_autograd import aot_module_simplified

GraphCompiler = Callable[[torch.fx.GraphModule, Sequence[Any], bool], Callable[..., Any]]


def capture_and_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                        compile_graph: GraphCompiler, keep_input_mutations: bool) -> Callable[..., Any]:
    """Trace `gm` through AOT autograd and compile every resulting graph with `compile_graph`."""

    def inference(g: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        return compile_graph(g, inputs, True)

    def training(g: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        return compile_graph(g, inputs, False)

    # AOT autograd's own cache stores Inductor's OutputCode only; torch's AOT compile (and vLLM's) force it on, and
    # then fail on any other compiler's result. The backend's cache and precompiled artifact cover what it would.
    with torch._functorch.config.patch(force_autograd_cache=False, bundled_autograd_cache=False):
        return aot_module_simplified(
            gm, example_inputs,
            fw_compiler=training, bw_compiler=training, inference_compiler=inference,
            keep_inference_input_mutations=keep_input_mutations,
        )


def float_inputs(gm: torch.fx.GraphModule) -> dict[int, str]:
    """Placeholder position -> the symbol of the Python float Dynamo passes as that 0-dim tensor input."""
    found = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        memo = getattr(node.meta.get("example_value"), "item_memo", None)
        name = getattr(getattr(getattr(memo, "node", None), "_expr", None), "name", None)
        if isinstance(name, str):
            found[i] = name
    return found


def restart_request(exc: BaseException) -> BaseException | None:
    """Dynamo's restart request under the errors that wrap it (a pass's error, a compile step's), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, TensorifyScalarRestartAnalysis):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None

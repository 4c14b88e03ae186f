"""Capture: Dynamo's graph -> AOT autograd's functional ATen graph with fake tensors in node.meta["val"].

Inference graphs (no gradient needed) go to `compile_graph(..., inference=True)` and get every pass;
graphs that need autograd are split by AOT into forward and backward, and each is compiled with
inference-only passes skipped. Symbolic sizes from Dynamo stay symbolic (placeholders of SymInt).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx
from torch._functorch.aot_autograd import aot_module_simplified

GraphCompiler = Callable[[torch.fx.GraphModule, Sequence[Any], bool], Callable[..., Any]]


def capture_and_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                        compile_graph: GraphCompiler, keep_input_mutations: bool) -> Callable[..., Any]:
    """Trace `gm` through AOT autograd and compile every resulting graph with `compile_graph`."""

    def inference(g: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        return compile_graph(g, inputs, True)

    def training(g: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        return compile_graph(g, inputs, False)

    return aot_module_simplified(
        gm, example_inputs,
        fw_compiler=training, bw_compiler=training, inference_compiler=inference,
        keep_inference_input_mutations=keep_input_mutations,
    )

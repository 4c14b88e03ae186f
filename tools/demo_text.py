"""The demo's text: the trained checkpoint continuing held-out prompts greedily, eager vs compiled vs compiled
with quant="dsa" (FP8 cache), shown as text so a person can judge what the compiler and the quantization keep."""
from __future__ import annotations

import time
from typing import Any

import torch
from rich.table import Table

from npu_graph.models.hybrid import HybridLM, generate_greedy
from npu_graph.observe import progress
from npu_graph.tools.trained_accuracy import as_text

PROMPT_TAIL = 40        # characters of each prompt shown before its continuation


def quantized(model: HybridLM) -> Any:
    """The model compiled with quant="dsa" (FP8 cache), as the demo shows it."""
    return torch.compile(model, backend="ascend_dsa", options={"quant": "dsa", "cache": False})


def warm(compiled: Any, model: HybridLM, prompt: torch.Tensor, kv_dtype: torch.dtype = torch.float32) -> float:
    """Compile `compiled`'s graphs by a short continuation (prefill, first decode step, then the decode graph every
    later step takes), called as `continuations` calls it; returns the first (prefill-compiling) call's seconds."""
    seconds = []

    def timed(ids: torch.Tensor, cache: Any) -> torch.Tensor:
        start = time.perf_counter()
        logits = compiled(ids, cache)
        seconds.append(time.perf_counter() - start)
        return logits

    with torch.no_grad():
        generate_greedy(timed, prompt, 3, model.new_cache(1, kv_dtype=kv_dtype))
    return seconds[0]


def continuations(model: HybridLM, prompts: torch.Tensor, steps: int, compiled: Any,
                  quantized_model: Any) -> dict[str, torch.Tensor]:
    """Greedy continuations [P, steps] of `prompts` [P, L] by the eager model, `compiled` (the demo's compiled
    model) and `quantized_model` (`quantized(model)`) on an FP8 cache."""
    runs = {"eager": (model, torch.float32), "ascend_dsa": (compiled, torch.float32),
            "ascend_dsa quant=dsa": (quantized_model, torch.float8_e4m3fn)}
    outputs = {}
    for name, (fn, kv_dtype) in runs.items():
        # one prompt at a time, each a tensor of its own: the demo's graphs were compiled for one sequence, and
        # a batch (or a row view, whose storage offset Dynamo guards on) would compile new graphs for each run
        with progress.step(f"{name}: {prompts.shape[0]} prompts, {steps} bytes each", "demo"):
            outputs[name] = torch.cat([generate_greedy(fn, prompt[None].clone(), steps,
                                                       model.new_cache(1, kv_dtype=kv_dtype)) for prompt in prompts])
    return outputs


def _shown(text: str) -> str:
    return text.replace("\n", "⏎").replace("\t", "⇥")


def text_table(prompts: torch.Tensor, outputs: dict[str, torch.Tensor]) -> Table:
    """One section per prompt: its last characters, then each run's continuation (⏎ marks a newline)."""
    table = Table(title="held-out prompts continued greedily (⏎ = newline)")
    table.add_column("run", no_wrap=True)
    table.add_column("text", overflow="fold")
    for i, prompt in enumerate(prompts):
        table.add_row("prompt …", _shown(as_text(prompt)[-PROMPT_TAIL:]))
        for name, tokens in outputs.items():
            same = "" if name == "eager" or torch.equal(tokens[i], outputs["eager"][i]) else " (differs)"
            table.add_row(f"{name}{same}", _shown(as_text(tokens[i])), end_section=name == list(outputs)[-1])
    return table


def text_results(prompts: torch.Tensor, outputs: dict[str, torch.Tensor]) -> list[dict[str, str]]:
    """The same for --json: prompt and continuation texts per run."""
    return [{"prompt": as_text(p), **{name: as_text(tokens[i]) for name, tokens in outputs.items()}}
            for i, p in enumerate(prompts)]

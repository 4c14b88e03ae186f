"""Accuracy of quant="dsa" (FP8 cache) against quant="none" (float cache) on the compiled reference model.

Both runs prefill the same prompt and decode greedily; every call of the two fused DSA ops is recorded (by
wrapping their CPU implementations for the duration: Dynamo refuses to run under a Python dispatch mode), so the
indexer's picks and sparse attention's outputs are compared call by call (the quantized run's errors
accumulate through the layers, as they would in deployment). Sparse attention is also measured alone: each
float-cache call rerun on identical inputs with the KV quantized to FP8 block-128 (the op's own error).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from npu_graph.kernels.indexer import lightning_indexer
from npu_graph.kernels.sparse_attention import sparse_flash_attention
from npu_graph.models.hybrid import HybridConfig, HybridLM, generate_greedy

IMPLEMENTATIONS = {"indexer": (lightning_indexer, "_lightning_indexer_cpu"),
                   "attention": (sparse_flash_attention, "_sparse_flash_attention_cpu")}


def _snapshot(args: tuple[Any, ...]) -> list[Any]:
    """The arguments with every tensor cloned once (a tensor passed twice stays one tensor)."""
    clones: dict[int, torch.Tensor] = {}
    for a in args:
        if isinstance(a, torch.Tensor) and id(a) not in clones:
            clones[id(a)] = a.clone()
    return [clones.get(id(a), a) for a in args]


@contextlib.contextmanager
def record_fused_calls() -> Iterator[dict[str, list[Any]]]:
    """Output 0 of every lightning_indexer / sparse_flash_attention call made inside, in call order, and the
    arguments of every sparse_flash_attention call (under "attention_args")."""
    calls: dict[str, list[Any]] = {name: [] for name in [*IMPLEMENTATIONS, "attention_args"]}
    originals = {name: getattr(module, attr) for name, (module, attr) in IMPLEMENTATIONS.items()}

    def recording(name: str):
        def call(*args: Any) -> Any:
            out = originals[name](*args)
            calls[name].append(out[0].clone())
            if name == "attention":
                calls["attention_args"].append(_snapshot(args))
            return out
        return call

    try:
        for name, (module, attr) in IMPLEMENTATIONS.items():
            setattr(module, attr, recording(name))
        yield calls
    finally:
        for name, (module, attr) in IMPLEMENTATIONS.items():
            setattr(module, attr, originals[name])


def _run(model: HybridLM, prompt: torch.Tensor, steps: int, options: dict[str, Any], kv_dtype: torch.dtype
         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, list[torch.Tensor]]]:
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ascend_dsa", options={"cache": False, "strict": True, **options},
                             fullgraph=True)
    with torch.no_grad(), record_fused_calls() as calls:
        logits = compiled(prompt, model.new_cache(1, kv_dtype=kv_dtype))
        tokens = generate_greedy(compiled, prompt, steps, model.new_cache(1, kv_dtype=kv_dtype))
    return logits, tokens, calls


def _recall(ref: torch.Tensor, out: torch.Tensor) -> tuple[int, int]:
    """(hits, valid) of the reference's valid picks found among the quantized run's, over all query rows."""
    ref_rows, out_rows = ref.reshape(-1, ref.shape[-1]), out.reshape(-1, out.shape[-1])
    hits = valid = 0
    for r, o in zip(ref_rows.tolist(), out_rows.tolist()):
        picks = {i for i in r if i >= 0}
        hits += len(picks & set(o))
        valid += len(picks)
    return hits, valid


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def fp8_kv_attention_cosines(calls: list[list[Any]]) -> list[float]:
    """Sparse attention alone: each recorded float-cache call rerun on the same inputs with its latent KV
    quantized to FP8 block-128 (`dynamic_block_quant`), cosine of the two outputs."""
    cosines = []
    for args in calls:
        key, value = args[1:3]
        if key.dtype == torch.float8_e4m3fn or key is not value:
            continue
        codes, scale = torch.ops.ascend_dsa.dynamic_block_quant(key)
        quantized = list(args)
        quantized[1:3], quantized[10:12] = [codes, codes], [scale, scale]
        exact = sparse_flash_attention._sparse_flash_attention_cpu(*args)[0]
        approx = sparse_flash_attention._sparse_flash_attention_cpu(*quantized)[0]
        cosines.append(_cosine(exact, approx))
    return cosines


class Reference(NamedTuple):
    """The quant="none" run (float32 cache) that every comparison is made against."""

    name: str
    model: HybridLM
    prompt: torch.Tensor
    steps: int
    logits: torch.Tensor
    tokens: torch.Tensor
    calls: dict[str, list[Any]]


def reference_run(name: str, config: HybridConfig, prompt_len: int, steps: int) -> Reference:
    """Build the model (seeded) and its prompt, and run quant="none" once for all the comparisons."""
    torch.manual_seed(0)
    model = HybridLM(config).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    logits, tokens, calls = _run(model, prompt, steps, {"quant": "none"}, torch.float32)
    return Reference(name, model, prompt, steps, logits, tokens, calls)


def _identical_steps(ref: Reference, tokens: torch.Tensor) -> int:
    """Greedy steps equal to the reference's before the first difference."""
    return int((ref.tokens == tokens).int().cumprod(dim=1).sum().item())


def measure_accuracy(ref: Reference) -> dict[str, Any]:
    """Logits cosine, greedy agreement, indexer recall and sparse attention cosine of quant="dsa"."""
    logits, tokens, calls = _run(ref.model, ref.prompt, ref.steps, {"quant": "dsa"}, torch.float8_e4m3fn)
    same = _identical_steps(ref, tokens)
    per_forward = ref.model.config.layer_types.count("dsa")
    comparable = per_forward * (2 + min(same, ref.steps - 1))   # two prefills, then decode steps fed equal tokens
    hits = valid = 0
    for a, b in zip(ref.calls["indexer"][:comparable], calls["indexer"][:comparable]):
        h, v = _recall(a, b)
        hits, valid = hits + h, valid + v
    attention = [_cosine(a, b) for a, b in zip(ref.calls["attention"][:comparable], calls["attention"][:comparable])]
    isolated = fp8_kv_attention_cosines(ref.calls["attention_args"])
    return {"op_attention_cosine_min": min(isolated, default=float("nan")), "op_attention_calls": len(isolated),
            "config": ref.name, "prompt": ref.prompt.shape[1], "decode_steps": ref.steps,
            "logits_cosine": _cosine(ref.logits, logits), "greedy_identical_steps": same,
            "indexer_recall": hits / max(valid, 1), "attention_cosine_min": min(attention, default=float("nan")),
            "attention_cosine_mean": sum(attention) / max(len(attention), 1), "compared_calls": len(attention)}


ABLATIONS = {  # name: (compile options, cache dtype), each against quant="none" on a float32 cache
    "kv fp8 only": ({"quant.kv": "fp8_block128"}, torch.float8_e4m3fn),
    "indexer mxfp8 only": ({"quant.indexer": "mxfp8"}, torch.float32),
    "bf16 cache, no quantization": ({"quant": "none"}, torch.bfloat16),
}


def ablation_rows(ref: Reference) -> list[dict[str, Any]]:
    """Logits cosine and identical greedy steps of each part of the policy alone, and of a BF16 cache with no
    quantization at all: how much of the error each part brings, and how far this model amplifies rounding."""
    rows = []
    for name, (options, kv_dtype) in ABLATIONS.items():
        logits, tokens, _ = _run(ref.model, ref.prompt, ref.steps, options, kv_dtype)
        rows.append({"case": f"accuracy ablation: {name}", "logits_cosine": _cosine(ref.logits, logits),
                     "greedy_identical_steps": _identical_steps(ref, tokens), "decode_steps": ref.steps})
    return rows

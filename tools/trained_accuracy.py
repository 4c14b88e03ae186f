"""Accuracy of quant="dsa" on the trained checkpoint and held-out text (issue 5's targets, measured where the
model's outputs mean something).

Teacher-forced: fixed held-out windows run through the compiled model with quant="none" on a float32 cache and
with a policy on its cache dtype; compared are the perplexity of the true next bytes, the top-1 agreement and
cosine of the logits per position, and the lightning indexer's top-K recall (every indexer call of the two runs
sees the same tokens). Free-running: greedy continuations of held-out prompts, counted identical or not, and
kept as text so a person can read them.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from npu_graph.models.hybrid import HybridLM, generate_greedy
from npu_graph.tools.quant_accuracy import _recall, record_fused_calls
from npu_graph.training import corpus

WINDOWS, WINDOW_LEN = 16, 256
PROMPTS, PROMPT_LEN, CONTINUATION = 8, 128, 64


class HeldoutRun(NamedTuple):
    """One policy's outputs on the held-out windows and prompts."""
    logits: torch.Tensor            # [WINDOWS, WINDOW_LEN, vocab]
    indexer: list[torch.Tensor]     # every indexer call's top-K picks, in call order
    continuations: torch.Tensor     # [PROMPTS, CONTINUATION]


def heldout_data(windows: int = WINDOWS, prompts: int = PROMPTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forcing windows [N, WINDOW_LEN + 1] and prompts [P, PROMPT_LEN] from the held-out files."""
    text = corpus.load_corpus(max_train_bytes=1)
    windows_t = corpus.fixed_windows(text.heldout, windows, WINDOW_LEN)
    prompt_rows = corpus.fixed_windows(text.heldout[text.heldout.numel() // 7:], prompts, PROMPT_LEN - 1)
    return windows_t, prompt_rows


def run_policy(model: HybridLM, windows: torch.Tensor, prompts: torch.Tensor, options: dict[str, Any],
               kv_dtype: torch.dtype, steps: int = CONTINUATION) -> HeldoutRun:
    """The compiled model under `options` on a `kv_dtype` cache: teacher-forced logits, indexer picks, and
    greedy continuations."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ascend_dsa", options={"cache": False, "strict": True, **options},
                             fullgraph=True)
    with torch.no_grad(), record_fused_calls() as calls:
        logits = compiled(windows[:, :-1], model.new_cache(windows.shape[0], kv_dtype=kv_dtype))
    with torch.no_grad():
        tokens = generate_greedy(compiled, prompts, steps, model.new_cache(prompts.shape[0], kv_dtype=kv_dtype))
    return HeldoutRun(logits, calls["indexer"], tokens)


def compare(reference: HeldoutRun, run: HeldoutRun, targets: torch.Tensor) -> dict[str, Any]:
    """The accuracy object of `ascend-dsa bench quant --json` for `run` against `reference`."""
    ce_ref = F.cross_entropy(reference.logits.flatten(0, 1), targets.flatten()).item()
    ce_run = F.cross_entropy(run.logits.flatten(0, 1), targets.flatten()).item()
    cosine = F.cosine_similarity(reference.logits.double(), run.logits.double(), dim=-1)
    hits = valid = 0
    for a, b in zip(reference.indexer, run.indexer):
        h, v = _recall(a, b)
        hits, valid = hits + h, valid + v
    same = (reference.continuations == run.continuations).all(dim=1)
    return {"perplexity_increase": math.exp(ce_run - ce_ref) - 1.0,
            "top1_agreement": (reference.logits.argmax(-1) == run.logits.argmax(-1)).float().mean().item(),
            "logits_cosine_mean": cosine.mean().item(), "logits_cosine_min": cosine.min().item(),
            "indexer_recall": hits / max(valid, 1), "greedy_identical_prompts": int(same.sum()),
            "prompts": len(same), "heldout_bits_per_byte_none": ce_ref / math.log(2),
            "heldout_bits_per_byte": ce_run / math.log(2), "positions": targets.numel()}


def as_text(tokens: torch.Tensor) -> str:
    """Bytes as readable text (undecodable bytes replaced)."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")

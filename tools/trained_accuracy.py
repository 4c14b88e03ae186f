"""Accuracy of quant="dsa" on the trained checkpoint and held-out text (issue 5's targets, measured where the
model's outputs mean something).

Fixed held-out windows are prefilled by the compiled model with quant="none" on a float32 cache and with a
policy on its cache dtype. Teacher-forced (the prefill): the perplexity of the true next bytes, the top-1
agreement and cosine of the logits per position, and the lightning indexer's top-K recall (the indexer calls
of the two prefills see the same tokens). Free-running: each window continued greedily on its cache, counted
identical or not, and kept as text so a person can read them.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from npu_graph.models.hybrid import HybridLM
from npu_graph.tools.quant_accuracy import _recall, record_fused_calls
from npu_graph.training import corpus

WINDOWS, WINDOW_LEN, CONTINUATION = 8, 256, 64


class HeldoutRun(NamedTuple):
    """One policy's outputs on the held-out windows."""
    logits: torch.Tensor            # [WINDOWS, WINDOW_LEN, vocab]: teacher-forced, the prefill's logits
    indexer: list[torch.Tensor]     # every indexer call's top-K picks during the prefill, in call order
    continuations: torch.Tensor     # [WINDOWS, steps]: greedy bytes after each window


def heldout_data(windows: int = WINDOWS) -> torch.Tensor:
    """Held-out windows [N, WINDOW_LEN + 1]: the prompt, and its true next bytes as targets."""
    return corpus.fixed_windows(corpus.load_corpus(max_train_bytes=1).heldout, windows, WINDOW_LEN)


def run_policy(model: HybridLM, windows: torch.Tensor, options: dict[str, Any], kv_dtype: torch.dtype,
               steps: int = CONTINUATION) -> HeldoutRun:
    """The compiled model under `options` on a `kv_dtype` cache: each window's prefill gives the
    teacher-forced logits and the indexer's picks; greedy decoding then continues it on the same cache."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ascend_dsa", options={"cache": False, "strict": True, **options},
                             fullgraph=True)
    cache = model.new_cache(windows.shape[0], kv_dtype=kv_dtype)
    with torch.no_grad():
        with record_fused_calls() as calls:
            logits = compiled(windows[:, :-1], cache)
        token = logits[:, -1].argmax(dim=-1, keepdim=True)
        tokens = [token]
        for _ in range(steps - 1):
            token = compiled(token, cache)[:, -1].argmax(dim=-1, keepdim=True)
            tokens.append(token)
    return HeldoutRun(logits, calls["indexer"], torch.cat(tokens, dim=1))


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

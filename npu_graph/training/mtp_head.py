"""Train the MTP head (npu_graph.models.mtp) of a trained HybridLM with the main model frozen.

Each step takes random training windows x_0..x_L, runs the main model in eval mode (no gradient) for its last
hidden states h_i, and trains the head to predict x_{i+2} from (h_i, x_{i+1}) — DeepSeek-V3's MTP objective at
depth 1 — plus the KL loss of the head's own lightning indexer (as the main model's indexers are trained). The
embedding and output head are the main model's, frozen. AdamW with warm-up and cosine decay over a time
budget. The result is saved as a checkpoint of the model with `mtp_layers=1` beside the main one
(`default_dir(...)` + "-mtp"), with its record: steps, seconds, held-out MTP loss in bits per byte and the
held-out rate at which the head's top guess is the true byte two ahead. `trained_mtp_model` loads that checkpoint
when it was trained on the current main checkpoint, else trains it first (`bench spec` runs on it).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from npu_graph.models.cache import HybridCache
from npu_graph.models.hybrid import HybridLM, aux_losses
from npu_graph.models.mtp import mtp_block_config
from npu_graph.training import checkpoint, corpus

LN2 = math.log(2.0)
SEQ_LEN, BATCH, LR, WARMUP, KL_WEIGHT = 128, 8, 3e-3, 20, 0.5
MINUTES = 3.0


def mtp_dir(config: str, seed: int) -> Path:
    """Where the model with its trained MTP head is kept: beside the main checkpoint."""
    main = checkpoint.default_dir(config, seed)
    return main.with_name(main.name + "-mtp")


def base_digest(path: Path) -> str:
    """Identifies a main checkpoint by its training record."""
    return hashlib.sha256(json.dumps(checkpoint.load_record(path), sort_keys=True).encode()).hexdigest()


def trained_mtp_model(config: str = "stdlib", seed: int = 0, minutes: float = MINUTES) -> HybridLM:
    """The trained main checkpoint (trained first when absent) with an MTP head trained on it: loaded from
    `mtp_dir` when it was trained on this main checkpoint, else trained now for `minutes` (once per machine)."""
    from npu_graph.training.loop import trained_model

    base = trained_model(config, seed)
    digest, path = base_digest(checkpoint.default_dir(config, seed)), mtp_dir(config, seed)
    try:
        if checkpoint.load_record(path).get("base_record_sha256") == digest:
            return HybridLM.from_pretrained(path)
    except checkpoint.CheckpointError:
        pass
    print(f"ascend-dsa: training the MTP head of the {config} checkpoint ({minutes:g} minutes, once per machine)",
          file=sys.stderr, flush=True)
    model = with_mtp_head(base)
    train_mtp_head(model, minutes, path, seed, extra={"base_record_sha256": digest})
    return model


def with_mtp_head(model: HybridLM) -> HybridLM:
    """A copy of `model` with a fresh MTP head (mtp_layers=1): the main weights are `model`'s."""
    torch.manual_seed(0)
    out = HybridLM(dataclasses.replace(model.config, mtp_layers=1)).eval()
    missing, unexpected = out.load_state_dict(model.state_dict(), strict=False)
    if unexpected or not all(name.startswith("mtp.") for name in missing):
        raise ValueError(f"with_mtp_head: the weights do not fit the model (unexpected {unexpected})")
    return out


def mtp_loss(model: HybridLM, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy of x_{i+2} in nats, top-1 hits) over windows `[B, L + 1]`; the head's indexer KL loss is
    left in its modules (aux_losses) when the head is in training mode."""
    batch, length = windows.shape[0], windows.shape[1] - 1
    blocks = -(-length // model.config.block_size)
    config = dataclasses.replace(model.config, max_context=blocks * model.config.block_size)
    with torch.no_grad():
        _, hidden = model(windows[:, :-1], HybridCache(config, batch), return_hidden=True)
        embeds = model.embed(windows[:, 1:-1])
    h = model.mtp(hidden[:, :-1], embeds, HybridCache(mtp_block_config(config), batch))
    logits = model.lm_head(model.mtp.norm(h))
    targets = windows[:, 2:]
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return ce, (logits.argmax(-1) == targets).float().mean()


def train_mtp_head(model: HybridLM, minutes: float, out: str | Path, seed: int = 0, *,
                   extra: dict[str, Any] | None = None, max_steps: int | None = None,
                   max_train_bytes: int | None = None) -> dict[str, Any]:
    """Train `model.mtp` (the rest frozen) for `minutes` (or exactly `max_steps` steps), save the model at `out`
    with its record (and `extra`); returns the record. `max_train_bytes` shortens the corpus (tests)."""
    text = corpus.load_corpus(max_train_bytes=max_train_bytes)
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("mtp."))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
    model.eval()
    model.mtp.train()
    began, step, budget = time.perf_counter(), 0, 60.0 * minutes
    while (done := step / max_steps if max_steps else (time.perf_counter() - began) / budget) < 1.0:
        factor = min((step + 1) / WARMUP, 0.1 + 0.45 * (1.0 + math.cos(math.pi * done)))
        for group in optimizer.param_groups:
            group["lr"] = LR * factor
        ce, _ = mtp_loss(model, corpus.random_windows(text.train, BATCH, SEQ_LEN, generator))
        loss = ce + KL_WEIGHT * aux_losses(model).get("indexer_kl", ce.new_zeros(()))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
    model.eval()
    for param in model.parameters():
        param.requires_grad_(True)
    with torch.no_grad():
        ce, hits = mtp_loss(model, corpus.fixed_windows(text.heldout, 32, SEQ_LEN))
    record = {"steps": step, "seconds": time.perf_counter() - began, "heldout_mtp_bits_per_byte": ce.item() / LN2,
              "heldout_mtp_top1": hits.item(), "seq_len": SEQ_LEN, "batch": BATCH, "seed": seed, **(extra or {})}
    checkpoint.save(model, record, out)
    return record

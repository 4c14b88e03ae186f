"""Train the reference HybridLM on the stdlib corpus: `train(TrainSettings(...)) -> dict`.

Each step takes `batch` random windows of `seq_len` + 1 bytes from the training part, runs the model in
training mode from an empty cache sized to the window, and minimises

    cross-entropy of the next byte  +  indexer_kl_weight · KL(dense attention ‖ indexer)  +  balance_weight · balance
    [ + mtp_weight · cross-entropy of the byte two ahead, when the config has an MTP head ]

(the indexers read detached inputs, so the KL term trains only them, as DeepSeek-V3.2 trains its indexer; the
balance term is DeepSeek-V3's complementary load-balance loss of the MoE routers). With `mtp_layers=1` (config
"stdlib-mtp") the multi-token-prediction head is trained with the model, as DeepSeek-V3 trains it: from the last
hidden state h_i and the embedding of x_{i+1} it predicts x_{i+2}; its loss, weighted by λ = `mtp_weight`
(DeepSeek-V3: 0.3, later 0.1), reaches the shared embedding and output head and, through h, the whole model; its
own indexer joins the KL term. The MTP loss is reported beside the main loss (`mtp_bits_per_byte`) and
evaluated on the held-out windows with the head's top-1 rate two ahead. AdamW, linear warm-up then
cosine decay over the planned steps (or, when only a time budget is given, over the budget's elapsed
fraction), gradient norm clipped at 1. With `max_steps` a run is reproducible bit for bit for its seed.
At the end the model is evaluated on fixed held-out windows (bits per byte) and saved with its record and
loss curve (npu_graph.models.checkpoint, npu_graph.training.curve).
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from npu_graph.cache.disk_store import default_root
from npu_graph.models import checkpoint
from npu_graph.models.cache import HybridCache
from npu_graph.models.hybrid import HybridConfig, HybridLM, aux_losses
from npu_graph.models.mtp import mtp_block_config
from npu_graph.training import corpus, curve
from npu_graph.training.progress import StepReporter

LN2 = math.log(2.0)
QUICK_MINUTES = 1.0     # the demo's own checkpoint when `ascend-dsa train` has not made one
# ... in small steps: 4 x 128 bytes gave 71 steps and 3.83 held-out bits/byte in 30 s on one core, where the
# default 8 x 256 gave 18 steps and 4.61 (AMD EPYC; early training is bound by the number of updates)
QUICK_BATCH, QUICK_SEQ_LEN = 4, 128


@dataclass
class TrainSettings:
    """What a run does; every field is recorded in the checkpoint's training.json."""
    config: str = "stdlib"
    seed: int = 0
    batch: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    minutes: float = 10.0
    max_steps: int | None = None
    indexer_kl_weight: float = 0.5
    balance_weight: float = 0.01
    eval_windows: int = 64
    eval_every: int = 100
    max_train_bytes: int | None = None
    mtp_weight: float = 0.3     # λ of the MTP loss; used only when the config has an MTP head


def bits_per_byte(model: HybridLM, windows: torch.Tensor, batch: int) -> float:
    """Mean next-byte cross-entropy in bits over `windows` [N, L + 1], in eval mode."""
    return heldout_scores(model, windows, batch)["bits_per_byte"]


def heldout_scores(model: HybridLM, windows: torch.Tensor, batch: int) -> dict[str, float]:
    """`bits_per_byte` over `windows` [N, L + 1] in eval mode; with an MTP head also its cross-entropy in bits
    for the byte two ahead (`mtp_bits_per_byte`) and how often its top guess is that byte (`mtp_top1`)."""
    was_training = model.training
    model.eval()
    sums = {"bits_per_byte": 0.0, "mtp_bits_per_byte": 0.0, "mtp_top1": 0.0}
    counts = {"main": 0, "mtp": 0}
    with torch.no_grad():
        for part in windows.split(batch):
            logits, mtp_logits = predict(model, part)
            sums["bits_per_byte"] += _cross_entropy(logits, part[:, 1:], "sum").item()
            counts["main"] += part[:, 1:].numel()
            if mtp_logits is not None:
                sums["mtp_bits_per_byte"] += _cross_entropy(mtp_logits, part[:, 2:], "sum").item()
                sums["mtp_top1"] += (mtp_logits.argmax(-1) == part[:, 2:]).sum().item()
                counts["mtp"] += part[:, 2:].numel()
    model.train(was_training)
    scores = {"bits_per_byte": sums["bits_per_byte"] / counts["main"] / LN2}
    if counts["mtp"]:
        scores.update(mtp_bits_per_byte=sums["mtp_bits_per_byte"] / counts["mtp"] / LN2,
                      mtp_top1=sums["mtp_top1"] / counts["mtp"])
    return scores


def predict(model: HybridLM, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(next-byte logits `[B, L, vocab]` of windows `[B, L + 1]` from an empty cache; with an MTP head, its logits
    for the byte two ahead `[B, L - 1, vocab]` from the main model's hidden states and the next bytes, else None)."""
    batch, length = windows.shape[0], windows.shape[1] - 1
    logits, hidden = model(windows[:, :-1], _window_cache(model.config, batch, length), return_hidden=True)
    if not model.config.mtp_layers:
        return logits, None
    mtp_cache = _window_cache(mtp_block_config(model.config), batch, length - 1)
    return logits, model.draft(hidden[:, :-1], windows[:, 1:-1], mtp_cache)[0]


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)


def _window_cache(config: HybridConfig, batch: int, length: int) -> HybridCache:
    """An empty cache holding exactly one window (whole blocks), so attention reads no unused capacity."""
    blocks = -(-length // config.block_size)
    return HybridCache(dataclasses.replace(config, max_context=blocks * config.block_size), batch)


def _lr_factor(settings: TrainSettings, step: int, fraction_done: float) -> float:
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(fraction_done, 1.0)))


def _step(model: HybridLM, optimizer: torch.optim.Optimizer, windows: torch.Tensor,
          settings: TrainSettings) -> dict[str, float]:
    logits, mtp_logits = predict(model, windows)
    ce = _cross_entropy(logits, windows[:, 1:])
    aux = aux_losses(model)
    loss = (ce + settings.indexer_kl_weight * aux.get("indexer_kl", ce.new_zeros(()))
            + settings.balance_weight * aux.get("balance", ce.new_zeros(())))
    reported = {"bits_per_byte": ce.item() / LN2}
    if mtp_logits is not None:
        mtp_ce = _cross_entropy(mtp_logits, windows[:, 2:])
        loss = loss + settings.mtp_weight * mtp_ce
        reported["mtp_bits_per_byte"] = mtp_ce.item() / LN2
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {**reported, **{name: value.item() for name, value in aux.items()}}


def train(settings: TrainSettings, out: str | Path | None = None, show_progress: bool = True) -> dict[str, Any]:
    """Run training (module docstring); returns the record saved with the checkpoint, plus `path`."""
    out = Path(out) if out is not None else default_dir(settings.config, settings.seed)
    text = corpus.load_corpus(max_train_bytes=settings.max_train_bytes)
    torch.manual_seed(settings.seed)
    model = HybridLM(HybridConfig.named(settings.config)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    generator = torch.Generator().manual_seed(settings.seed)
    heldout = corpus.fixed_windows(text.heldout, settings.eval_windows, settings.seq_len)
    budget_s = settings.minutes * 60.0
    history: list[tuple[int, float]] = []
    evals: list[tuple[int, float]] = []
    start, step, last = time.perf_counter(), 0, {}
    with StepReporter(settings.max_steps, budget_s, show_progress) as reporter:
        while _keep_going(settings, step, time.perf_counter() - start, budget_s):
            elapsed = time.perf_counter() - start
            fraction = step / settings.max_steps if settings.max_steps else elapsed / budget_s
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * _lr_factor(settings, step, fraction)
            windows = corpus.random_windows(text.train, settings.batch, settings.seq_len, generator)
            last = _step(model, optimizer, windows, settings)
            step += 1
            history.append((step, last["bits_per_byte"]))
            if step % settings.eval_every == 0:
                evals.append((step, bits_per_byte(model, heldout, settings.batch)))
            reporter.update(step, last, settings.batch * settings.seq_len)
    seconds = time.perf_counter() - start
    scores = heldout_scores(model, heldout, settings.batch)
    final = scores["bits_per_byte"]
    evals.append((step, final))
    record = {"settings": dataclasses.asdict(settings), "steps": step, "seconds": round(seconds, 1),
              "corpus_digest": text.digest, "train_files": len(text.train_files),
              "heldout_files": len(text.heldout_files), "heldout_bits_per_byte": round(final, 4),
              **{f"heldout_{name}": round(value, 4) for name, value in scores.items() if name.startswith("mtp")},
              "final_losses": {k: round(v, 4) for k, v in last.items()}, "heldout_curve": evals,
              "torch": torch.__version__}
    checkpoint.save(model.eval(), record, out)
    curve.write_svg(out / "loss.svg", history, evals, f"{settings.config}: {step} steps, {seconds:.0f} s, "
                                                      f"held-out {final:.3f} bits/byte")
    return {**record, "path": str(out)}


def _keep_going(settings: TrainSettings, step: int, elapsed: float, budget_s: float) -> bool:
    if settings.max_steps is not None:
        return step < settings.max_steps
    return elapsed < budget_s


def default_dir(config_name: str, seed: int) -> Path:
    """Where `ascend-dsa train` keeps a checkpoint: under the compile cache's root (ASCEND_DSA_CACHE_DIR)."""
    return Path(default_root()) / "checkpoints" / f"{config_name}-seed{seed}"


def checkpoint_paths(config: str, seed: int, quick: bool) -> list[Path]:
    """Where `trained_model` looks, in order: the full checkpoint, and with `quick` the demo's beside it."""
    full = default_dir(config, seed)
    return [full, full.with_name(full.name + "-quick")] if quick else [full]


def load_first(paths: list[Path]) -> tuple[HybridLM | None, str]:
    """The first checkpoint of `paths` that loads, else (None, why the last one did not)."""
    reason = "no checkpoint path"
    for path in paths:
        try:
            return HybridLM.from_pretrained(path), ""
        except checkpoint.CheckpointError as e:
            reason = str(e)
    return None, reason


def announce_training(reason: str, minutes: float, quick: bool) -> None:
    print(f"ascend-dsa: no usable trained checkpoint ({reason}); training one now ({minutes:g} minutes, once per "
          f"machine{'; `ascend-dsa train` makes the full one' if quick else ''})", file=sys.stderr, flush=True)


def trained_model(config: str = "stdlib", seed: int = 0, quick: bool = False) -> HybridLM:
    """The checkpoint `ascend-dsa train` keeps for `config` and `seed`, trained first (with progress, default
    settings) when it is absent or cannot be loaded: what `bench quant` runs on. With `quick`, that checkpoint
    if it exists, else a QUICK_MINUTES one kept beside it."""
    paths = checkpoint_paths(config, seed, quick)
    model, reason = load_first(paths)
    if model is not None:
        return model
    settings = TrainSettings(config=config, seed=seed)
    if quick:
        settings = dataclasses.replace(settings, minutes=QUICK_MINUTES, batch=QUICK_BATCH, seq_len=QUICK_SEQ_LEN)
    announce_training(reason, settings.minutes, quick)
    train(settings, out=paths[-1])
    return HybridLM.from_pretrained(paths[-1])

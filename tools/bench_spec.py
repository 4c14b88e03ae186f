"""`ascend-dsa bench spec`: speculative greedy decoding (npu_graph.generate) against plain greedy decoding.

The model is the trained stdlib-mtp checkpoint (`ascend-dsa train --config stdlib-mtp`: the stdlib model with its MTP
head trained with it), trained first when absent, given room for the context (`--context`, default 4096; 256 with
`--quick`: max_context grows, the weights are the same). Prompts are held-out stdlib windows that fill the context
but for the new tokens; they are prefilled once (compiled, in chunks: npu_graph.generate.prefill) and every run,
eager or compiled, decodes from a copy of those caches. For eager and
compiled (backend ascend_dsa) decoding: plain greedy once, then per k = 1..4 speculative decoding with the MTP
head's drafts (checkpoint rollback; eager also replay) — the `rows` — and with oracle drafts (the plain greedy
tokens: every draft accepted, the speed a perfect draft head would reach at this verify cost) — `oracle_rows`,
kept apart so that nothing reading `rows` mistakes them for the draft head's. Tokens/s count decoded tokens
only (the prefill is left out), medians of runs that alternate plain and speculative decoding (a shared machine's
load then shifts both alike), after a warm-up run (which compiles, and lets kernels/native/dispatch.py measure its
choices). Per row: acceptance rate, mean tokens kept per round, the per-round cost split (draft, verify, rollback), a
plain decode step's time and a round's cost in decode steps (speedup = tokens per round / that), and whether the tokens
equal plain greedy decoding's.

`--wide N`: the same trained weights with each decoder layer's MLP (the dense one, or the MoE's shared expert)
widened to N intermediate units by zero rows and columns (the same function: the added units add exact zeros; the
MTP head is left as it is). A step then streams a large weight set, as a real-size model's decode step does, while
the drafts keep their acceptance: the regime where a verify step of k + 1 tokens costs about one plain step.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch

from npu_graph.generate import Decoder, Prefilled
from npu_graph.models.hybrid import HybridLM
from npu_graph.models.moe import SwiGLU
from npu_graph.observe import progress

KS = (1, 2, 3, 4)
CONFIG = "stdlib-mtp"
OPTIONS = {"cache": False, "verify": False}
SIZES = {False: (8, 128, 4096), True: (4, 32, 256)}      # --quick: (prompts, new tokens each, default context)


class OracleDecoder(Decoder):
    """Drafts the plain greedy tokens `truth` (the MTP head still runs, so its cost is counted)."""

    def __init__(self, model: HybridLM, truth: torch.Tensor, prompt_len: int, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.truth, self.prompt_len = truth, prompt_len

    def _draft(self, state, mtp_cache, k, stats):
        super()._draft(state, mtp_cache, k, stats)
        emitted = mtp_cache.lengths.long() - (k - 1) - self.prompt_len + 1
        index = (emitted.unsqueeze(1) + torch.arange(k)).clamp(max=self.truth.shape[1] - 1)
        return self.truth.gather(1, index)


def load_model() -> tuple[HybridLM, str]:
    """(the trained stdlib-mtp checkpoint: the stdlib model with its MTP head trained with it, what it is); trained
    first when absent (`ascend-dsa train --config stdlib-mtp`)."""
    from npu_graph.models import checkpoint
    from npu_graph.training.loop import default_dir, trained_model

    model = trained_model(CONFIG, 0)
    record = checkpoint.load_record(default_dir(CONFIG, 0))
    return model, (f"trained {CONFIG} checkpoint ({record['steps']} steps, {record['seconds']:.0f} s; held-out "
                   f"{record['heldout_bits_per_byte']:.2f} bits/byte, MTP head's top-1 of the byte two ahead "
                   f"{record['heldout_mtp_top1']:.2f})")


def with_context(model: HybridLM, context: int) -> HybridLM:
    """`model`'s weights in a model whose caches hold `context` tokens and the widest verify window."""
    config = model.config
    blocks = -(-(context + max(KS) + 1) // config.block_size)
    out = HybridLM(dataclasses.replace(config, max_context=blocks * config.block_size))
    out.load_state_dict(model.state_dict())
    return out.eval()


def widened(model: HybridLM, size: int) -> HybridLM:
    """`model` with each decoder layer's MLP (the dense one, or the MoE's shared expert) zero-padded to `size`
    intermediate units, in place: the padded units' gate and up rows and down columns are 0, so each adds silu(0)·0
    = 0 and the layer computes what it did (module docstring). The MTP head keeps its own MLP."""
    for layer in model.layers:
        owner, name = (layer, "mlp") if isinstance(layer.mlp, SwiGLU) else (layer.mlp, "shared_experts")
        old = getattr(owner, name)
        units = old.gate_proj.out_features
        if size < units:
            raise SystemExit(f"ascend-dsa bench spec: --wide {size} is narrower than the model's MLP ({units} units)")
        wide = SwiGLU(old.gate_proj.in_features, size)
        with torch.no_grad():
            for part in (wide.gate_proj, wide.up_proj, wide.down_proj):
                part.weight.zero_()
            wide.gate_proj.weight[:units] = old.gate_proj.weight
            wide.up_proj.weight[:units] = old.up_proj.weight
            wide.down_proj.weight[:, :units] = old.down_proj.weight
        setattr(owner, name, wide.to(old.gate_proj.weight.dtype))
    return model


def heldout_prompts(batch: int, length: int) -> torch.Tensor:
    """`batch` evenly spaced held-out windows of `length` bytes."""
    from npu_graph.training import corpus

    return corpus.fixed_windows(corpus.load_corpus(max_train_bytes=1).heldout, batch, length)[:, :length]


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def decode_seconds(decoder: Decoder, call: Any, *args: Any) -> tuple[Any, float]:
    """(the call's result, its wall time without the prefill)."""
    out, seconds = _timed(call, *args)
    return out, seconds - decoder.prefill_s


def spec_row(plain: Decoder, decoder: Decoder, prompts: Prefilled, steps: int, k: int, rollback: str,
             truth: torch.Tensor, repeat: int) -> dict[str, Any]:
    """One row: speculative and plain decoding timed alternately `repeat` times, medians of the decode times."""
    decoder.speculative(prompts, 2 * (k + 2), k, rollback)      # two rounds or more: every graph of this k
    plain_s, spec_s = [], []
    for _ in range(repeat):
        plain_s.append(decode_seconds(plain, plain.greedy, prompts, steps)[1])
        (out, stats), seconds = decode_seconds(decoder, decoder.speculative, prompts, steps, k, rollback)
        spec_s.append(seconds)
    decoded, rounds = prompts.first.shape[0] * (steps - 1), max(stats.rounds, 1)
    plain_rate, spec_rate = decoded / statistics.median(plain_s), decoded / statistics.median(spec_s)
    decode_ms = 1e3 * statistics.median(plain_s) / (steps - 1)
    split = {"draft_ms": stats.draft_s, "verify_ms": stats.verify_s, "rollback_ms": stats.rollback_s}
    split = {name: 1e3 * seconds / rounds for name, seconds in split.items()}
    return {"k": k, "compiled": decoder.backend is not None, "rollback": rollback,
            "acceptance_rate": stats.acceptance_rate, "mean_accepted_length": stats.mean_accepted_length,
            "tokens_per_s_plain": plain_rate, "tokens_per_s_spec": spec_rate, "speedup": spec_rate / plain_rate,
            "identical": bool(torch.equal(out, truth[:, :steps])), **split, "decode_ms": decode_ms,
            "round_in_decode_steps": sum(split.values()) / decode_ms}


def rows_for(model: HybridLM, prefilled: Prefilled, steps: int, compiled: bool, repeat: int
             ) -> list[dict[str, Any]]:
    """Speculative rows of one mode (eager or compiled) from the prompts' caches `prefilled`, each against plain
    greedy decoding timed beside it."""
    plain = Decoder(model, compiled=compiled, options=OPTIONS)
    plain.greedy(prefilled, 3)                                  # compiled: the decode step
    truth = plain.greedy(prefilled, steps + max(KS))
    rows = []
    for k in KS:
        for drafts, rollback in (("mtp", "checkpoint"), ("mtp", "replay"), ("oracle", "checkpoint")):
            if compiled and rollback == "replay":
                continue
            decoder = (OracleDecoder(model, truth, prefilled.width, compiled=compiled, options=OPTIONS)
                       if drafts == "oracle" else Decoder(model, compiled=compiled, options=OPTIONS))
            row = spec_row(plain, decoder, prefilled, steps, k, rollback, truth, repeat)
            rows.append({**row, "drafts": drafts})
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    batch, steps, context = SIZES[bool(args.quick)]
    context = getattr(args, "context", None) or context
    if context <= steps:
        raise SystemExit(f"ascend-dsa bench spec: --context {context} leaves no prompt before {steps} new tokens; "
                         f"give more than {steps}")
    repeat = args.repeat or 3
    trained, source = load_model()
    model = with_context(trained, context)
    wide = getattr(args, "wide", None)
    if wide:
        model = widened(model, wide)
        source += f"; each decoder layer's MLP zero-padded to {wide} units ({_mlp_bytes(model) / 2**20:.0f} MiB)"
    with progress.step(f"prefill of {batch} prompts of {context - steps} tokens (compiled)", "bench spec"):
        prefilled = Decoder(model, compiled=True, options=OPTIONS).prefill(heldout_prompts(batch, context - steps),
                                                                          draft=True)
    measured = []
    for compiled in (False, True):
        with progress.step(f"{'compiled' if compiled else 'eager'} plain and speculative decoding", "bench spec"):
            measured += rows_for(model, prefilled, steps, compiled, repeat)
    notes = [f"model: {source}; {batch} held-out prompts of {context - steps} bytes, {steps} new tokens each "
             f"({context} context), fp32",
             "rows: the MTP head's drafts; oracle_rows (a table of their own, not rows): plain greedy's tokens as "
             "drafts (all accepted), the speed a perfect draft head would reach with this verify cost",
             f"tokens/s count decoded tokens (prefill left out), medians of {repeat} runs alternating plain and "
             "speculative decoding; draft/verify/rollback ms are per round, decode_ms per plain decode step (all "
             "rows at once); round_in_decode_steps = (draft + verify + rollback) / decode_ms, so speedup ~ "
             "mean_accepted_length / round_in_decode_steps",
             "identical: the tokens equal plain greedy decoding's; timings on a shared machine are noisy"]
    return {"suite": "spec", "context": context, "wide": wide, "rows": [r for r in measured if r["drafts"] == "mtp"],
            "oracle_rows": [r for r in measured if r["drafts"] == "oracle"], "notes": notes}


def _mlp_bytes(model: HybridLM) -> int:
    """Bytes of the decoder layers' MLP weights that `--wide` widened."""
    return sum(p.numel() * p.element_size() for layer in model.layers for name, p in layer.mlp.named_parameters()
               if isinstance(layer.mlp, SwiGLU) or name.startswith("shared_experts"))


def print_text(result: dict[str, Any]) -> None:
    """The MTP rows' table with the notes, then the oracle rows' table."""
    from rich.console import Console

    from npu_graph.tools.bench import print_table

    console = Console()
    print_table(result, console)
    print_table({**result, "suite": "spec (oracle drafts)", "rows": result["oracle_rows"], "notes": []}, console)

"""`ascend-dsa bench quant`: what the quantize and layout_nz passes buy, side by side in one run.

Rows: cache bytes per token (FP8 block-128 latent and MXFP8 indexer key vs BF16), accuracy of quant="dsa" on
an FP8 cache vs quant="none" on a float cache (tools.quant_accuracy), the CPU GEMM forms behind the layout plan
(cpu_gemm_profile) summed over the reference model's linear layers at decode (M=1), and a compiled decode step
with the plan realised (nz="auto") vs not (nz="off"). Timings on a shared machine are noisy.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from npu_graph.models.cache import HybridCache
from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.observe import progress
from npu_graph.targets.cpu_gemm_profile import measure
from npu_graph.tools import trained_accuracy
from npu_graph.tools.quant_accuracy import ABLATIONS, ablation_rows, measure_accuracy, reference_run
from npu_graph.tools.timing import time_side_by_side
from npu_graph.training.loop import trained_model

CONFIG = "small"
TRAINED_CONFIG = "stdlib"


def cache_rows(name: str = CONFIG) -> list[dict[str, Any]]:
    config = HybridConfig.named(name)
    fp8 = HybridCache(config, 1, kv_dtype=torch.float8_e4m3fn).bytes_per_token()
    bf16 = HybridCache(config, 1, kv_dtype=torch.bfloat16).bytes_per_token()
    rows = [{"case": f"cache bytes/token {part}", "fp8": fp8[part], "bf16": bf16[part],
             "ratio": fp8[part] / bf16[part]} for part in ("latent", "index_k", "k_rope")]
    total_fp8, total_bf16 = sum(fp8.values()), sum(bf16.values())
    rows.append({"case": "cache bytes/token all", "fp8": total_fp8, "bf16": total_bf16,
                 "ratio": total_fp8 / total_bf16})
    return rows


def linear_shapes(model: HybridLM) -> list[tuple[int, int]]:
    return [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def gemm_rows(model: HybridLM, repeat: int) -> list[dict[str, Any]]:
    """The CPU GEMM forms for every linear weight of the model at M=1, and their sum (NT is the unplanned form)."""
    rows = measure([(1, n, k) for n, k in linear_shapes(model)], repeat)
    nt, nn = sum(r["fp32_nt_us"] for r in rows), sum(r["fp32_nn_us"] for r in rows)
    total = {"case": f"{CONFIG} linear layers M=1 (sum)", "fp32_nt_us": nt, "fp32_nn_us": nn,
             "nn_speedup_fp32": nt / nn}
    return [*measure([(64, 1024, 512), (64, 8192, 512)], repeat), total]


def decode_row(model: HybridLM, repeat: int) -> dict[str, Any]:
    """One compiled decode step at a 256-token context, layout plan realised vs not."""
    steps = {}
    for nz in ("auto", "off"):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="ascend_dsa", options={"cache": False, "nz": nz}, fullgraph=True)
        cache = model.new_cache(1)
        cache.fill_synthetic_(256)
        token = torch.zeros(1, 1, dtype=torch.long)

        def step(compiled=compiled, cache=cache, token=token) -> None:
            compiled(token, cache)
            cache.lengths.fill_(256)

        with torch.no_grad():
            step()
        steps[nz] = step
    with torch.no_grad():
        times = time_side_by_side(steps, repeat=repeat)
    return {"case": f"{CONFIG} compiled decode step", "plan_off_ms": times["off"] * 1e3,
            "plan_on_ms": times["auto"] * 1e3, "speedup": times["off"] / times["auto"]}


def accuracy_rows(model: HybridLM, quick: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """quant="dsa" and each ablation against quant="none" on held-out text (tools.trained_accuracy)."""
    windows = trained_accuracy.heldout_data(4 if quick else trained_accuracy.WINDOWS)
    steps = 16 if quick else trained_accuracy.CONTINUATION
    reference = trained_accuracy.run_policy(model, windows, {"quant": "none"}, torch.float32, steps)
    dsa = trained_accuracy.run_policy(model, windows, {"quant": "dsa"}, torch.float8_e4m3fn, steps)
    accuracy = trained_accuracy.compare(reference, dsa, windows[:, 1:])
    accuracy["examples"] = [{"prompt": trained_accuracy.as_text(w[-49:-1]),
                             "none": trained_accuracy.as_text(a), "dsa": trained_accuracy.as_text(b)}
                            for w, a, b in zip(windows[:3], reference.continuations, dsa.continuations)]
    rows = [{"case": "accuracy dsa vs none", **{k: v for k, v in accuracy.items() if k != "examples"}}]
    for name, (options, kv_dtype) in ABLATIONS.items():
        run = trained_accuracy.run_policy(model, windows, options, kv_dtype, steps)
        rows.append({"case": f"accuracy ablation: {name}", **trained_accuracy.compare(reference, run, windows[:, 1:])})
    return accuracy, rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    repeat = args.repeat or (5 if args.quick else 15)
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named(CONFIG)).eval()
    if getattr(args, "random_weights", False):
        with progress.step("accuracy of quant='dsa' on random weights", "bench quant"):
            reference = reference_run(CONFIG, HybridConfig.named(CONFIG), 272, 8 if args.quick else 32)
            rows = [*cache_rows(), {"case": "accuracy dsa vs none (random weights)", **measure_accuracy(reference)}]
            rows += ablation_rows(reference)
        accuracy = None
    else:
        trained = trained_model()
        with progress.step("accuracy of quant='dsa' on the trained checkpoint, held-out text", "bench quant"):
            accuracy, rows = accuracy_rows(trained, args.quick)
        rows = [*cache_rows(TRAINED_CONFIG), *rows]
    with progress.step("CPU GEMM weight forms", "bench quant"):
        rows += gemm_rows(model, 20 if args.quick else 50)
    with progress.step("compiled decode step, layout plan on vs off", "bench quant"):
        rows.append(decode_row(model, repeat))
    notes = ["accuracy: the trained checkpoint (ascend-dsa train) on held-out stdlib files, compiled; quant='dsa' on "
             "a float8_e4m3fn cache vs quant='none' on a float32 cache: teacher-forced perplexity, top-1 agreement "
             "and logits cosine per position, the indexer's top-K recall over every call, and greedy continuations "
             "of held-out prompts (identical or not); --random-weights measures the untrained small model instead",
             "targets: perplexity +<= 1 %, top-1 >= 99 %, logits cosine >= 0.995, recall >= 0.95, greedy identical "
             "on >= 7 of 8 prompts, cache ratios <= 0.52 (latent, index_k), layout speedup >= 1.2",
             "ablations: one part of the policy alone, and a BF16 cache with no quantization",
             "timings are medians of side-by-side rounds on a shared machine: noisy"]
    return {"suite": "quant", "rows": rows, "accuracy": accuracy, "notes": notes}

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

from npu_graph.cpu_gemm_profile import measure
from npu_graph.models.cache import HybridCache
from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.tools.quant_accuracy import ablation_rows, measure_accuracy, reference_run
from npu_graph.tools.timing import time_side_by_side

CONFIG = "small"


def cache_rows() -> list[dict[str, Any]]:
    config = HybridConfig.named(CONFIG)
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    repeat = args.repeat or (5 if args.quick else 15)
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named(CONFIG)).eval()
    reference = reference_run(CONFIG, HybridConfig.named(CONFIG), 272, 8 if args.quick else 32)
    rows = [*cache_rows(), {"case": "accuracy dsa vs none", **measure_accuracy(reference)}, *ablation_rows(reference),
            *gemm_rows(model, 20 if args.quick else 50), decode_row(model, repeat)]
    notes = ["accuracy: quant='dsa' on a kv_dtype=float8_e4m3fn cache vs quant='none' on a float32 cache; op "
             "figures compare calls made while both runs had been fed the same tokens; op_attention_cosine_min is "
             "sparse attention alone: the float run's calls rerun on identical inputs with the KV in FP8 block-128",
             "targets: cache ratios <= 0.52 (latent, index_k), recall >= 0.95, attention cosine >= 0.999, "
             "logits cosine >= 0.995, 32 identical greedy steps, layout speedup >= 1.2",
             "ablations: one part of the policy alone, and a BF16 cache with no quantization (this model's "
             "sensitivity to rounding alone)",
             "timings are medians of side-by-side rounds on a shared machine: noisy"]
    return {"suite": "quant", "rows": rows, "notes": notes}

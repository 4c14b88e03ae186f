"""`ascend-dsa bench cache`: cold vs warm start of the compile cache, each in a fresh process.

For each model, fresh processes run: a pass-through backend (Dynamo tracing only), ascend_dsa on an empty
cache (cold), and ascend_dsa again twice on the now warm cache. Each prints its first-call wall time and the
time spent inside the ascend_dsa backend itself (key, lookup/load or capture + passes + lowering). The
backend's share of the first call is reported two ways: first call minus the pass-through first call (as
users see it), and the time measured inside the backend.

The warm start as a whole is measured too, with torch's caching precompile on (TORCH_CACHING_PRECOMPILE=1), where
a warm process neither traces with Dynamo nor compiles: `first_call_*_s` is torch.compile(...) plus the first call,
Dynamo included (imports and the eager warm-up call before it are not counted), cold on an empty cache and warm
(the better of two processes); `process_*_s` is the whole process's wall time, start-up and imports included.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from npu_graph.observe import progress

PROGRAM = r"""
import json, sys, time, torch
kind, model_name = sys.argv[1], sys.argv[2]
if model_name == "reference":
    from npu_graph.models.hybrid import HybridConfig, HybridLM
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named("tiny")).eval()
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(1))
    call = lambda fn: fn(ids, model.new_cache(1))
else:
    import npu_graph  # noqa: F401  (before transformers: see kernels/__init__.py)
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("deepseek_v32", vocab_size=256, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=128, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1,
        index_n_heads=4, index_head_dim=16, index_topk=8)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    ids = torch.randint(3, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    call = lambda fn: fn(ids).logits
import torch._dynamo
inside = []
if kind == "trace":
    backend = lambda gm, example_inputs, **kw: gm.forward
else:
    import npu_graph
    backend = npu_graph.get_backend({})
    original = type(backend).__call__
    def timed(self, gm, example_inputs, **kw):
        start = time.perf_counter(); result = original(self, gm, example_inputs)
        inside.append(time.perf_counter() - start); return result
    type(backend).__call__ = timed
with torch.no_grad():
    call(model)
    wrap = time.perf_counter()
    compiled = torch.compile(model, backend=backend)
    start = time.perf_counter(); out = call(compiled); first = time.perf_counter() - start
    whole = time.perf_counter() - wrap
decisions = [r.cache for r in backend.reports] if kind != "trace" else []
print(json.dumps({"first_s": first, "whole_s": whole, "backend_s": sum(inside), "checksum": float(out.double().sum()),
                  "cache": decisions, "frames": torch._dynamo.utils.counters["frames"]["total"]}))
"""


def _run(kind: str, model: str, env: dict[str, str]) -> dict[str, Any]:
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", PROGRAM, kind, model], capture_output=True, text=True, env=env,
                       timeout=900)
    if p.returncode:
        raise RuntimeError(f"bench cache: {kind} run of {model} failed: {p.stderr.strip().splitlines()[-1:]}")
    return {**json.loads(p.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - start}


def measure_warm_start(model: str) -> dict[str, Any]:
    """Cold vs warm process with torch's caching precompile on: the whole first call, Dynamo included."""
    env = dict(os.environ, ASCEND_DSA_CACHE_DIR=tempfile.mkdtemp(prefix="ascend_dsa_bench_cache_"),
               TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(), TORCH_CACHING_PRECOMPILE="1")
    env.pop("ASCEND_DSA_SHARE_TRACES", None)
    cold = _run("ours", model, env)
    warm = min((_run("ours", model, env) for _ in range(2)), key=lambda r: r["whole_s"])
    return {"first_call_cold_s": cold["whole_s"], "first_call_warm_s": warm["whole_s"],
            "first_call_warm_over_cold": warm["whole_s"] / cold["whole_s"],
            "process_cold_s": cold["process_s"], "process_warm_s": warm["process_s"],
            "warm_frames_traced": warm["frames"], "warm_start_same_result": cold["checksum"] == warm["checksum"]}


def measure_model(model: str) -> dict[str, Any]:
    env = dict(os.environ, ASCEND_DSA_CACHE_DIR=tempfile.mkdtemp(prefix="ascend_dsa_bench_cache_"),
               TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp())
    for name in ("TORCH_CACHING_PRECOMPILE", "ASCEND_DSA_SHARE_TRACES"):     # these processes trace
        env.pop(name, None)
    trace = min(_run("trace", model, env)["first_s"] for _ in range(2))
    cold = _run("ours", model, env)
    warm = min((_run("ours", model, env) for _ in range(2)), key=lambda r: r["first_s"])
    share_cold, share_warm = max(cold["first_s"] - trace, 1e-3), max(warm["first_s"] - trace, 0.0)
    return {"case": model, "trace_first_s": trace, "cold_first_s": cold["first_s"], "warm_first_s": warm["first_s"],
            "share_warm_over_cold": share_warm / share_cold,
            "backend_cold_s": cold["backend_s"], "backend_warm_s": warm["backend_s"],
            "backend_warm_over_cold": warm["backend_s"] / max(cold["backend_s"], 1e-6),
            "cold_cache": ",".join(cold["cache"]), "warm_cache": ",".join(warm["cache"]),
            "same_result": cold["checksum"] == warm["checksum"], **measure_warm_start(model)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    models = ["reference"] if args.quick else ["reference", "transformers_deepseek_v32"]
    rows = []
    for model in models:
        with progress.step(f"{model}: first calls in fresh processes, cold and warm cache", "bench cache"):
            rows.append(measure_model(model))
    return {"suite": "cache", "rows": rows,
            "notes": ["every figure comes from a fresh process; share = first call - pass-through first call",
                      "backend_* is the time spent inside the ascend_dsa backend during the first call",
                      "first_call_* (TORCH_CACHING_PRECOMPILE=1): torch.compile plus the first call, Dynamo included"]}

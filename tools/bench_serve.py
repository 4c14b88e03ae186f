"""`ascend-dsa bench serve`: vLLM serving tiny Llama, Qwen3 and Qwen3-MoE checkpoints, vLLM's default compile vs
ascend_dsa as its compile backend (run in the vLLM environment that tools/vllm_env.sh builds).

For each family a random-weight checkpoint is built from its config in a temporary folder (no downloads), and fresh
`vllm.LLM` processes (npu_graph.vllm.serve_run) serve 16 prompts x 64 greedy new tokens (each process times 3
rounds and keeps its best): vLLM eager (the reference tokens), ascend_dsa on empty caches (cold), then 3 rounds of
a vLLM default compile process followed by an ascend_dsa process on the caches the cold run left (warm). The two
sides of a round run back to back, so its ratio compares them under the same machine load; the row reports the
median of the per-round ratios and each side's best. Both sides run with the same environment (threads included).
Each backend has its own VLLM_CACHE_ROOT, so vLLM's default compile never reads ours. Row fields: tokens_equal
(every ascend_dsa run gave eager's tokens), backend_graphs (graphs our backend compiled cold), round_ratios and
throughput_ratio (their median: ours warm / vLLM default, new tokens per second), ttft_ratio likewise,
warm_compile_ratio (vLLM's torch.compile time with ascend_dsa, the slowest warm process / the cold one), init_s
(building the LLM, compile included). vLLM's default compile on CPU is whole-graph Inductor, which vLLM does not
time (so only init_s covers its compile).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from npu_graph.observe import progress

PROMPTS, NEW_TOKENS, ROUNDS, PAIRS = 16, 64, 3, 3


def serve_in_child(spec: dict[str, Any], cache_root: str) -> dict[str, Any]:
    """Run npu_graph.vllm.serve_run in a fresh process with vLLM's cache under `cache_root`."""
    env = dict(os.environ, VLLM_CACHE_ROOT=cache_root, ASCEND_DSA_CACHE_DIR=os.path.join(cache_root, "ascend_dsa"))
    done = subprocess.run([sys.executable, "-m", "npu_graph.vllm.serve_run", json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("SERVE_RUN ")]
    if done.returncode or not lines:
        raise RuntimeError(f"bench serve: the {spec['mode']} run of {spec['folder']} failed:\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("SERVE_RUN "):])


def _median(values: list[float]) -> float:
    return statistics.median(values)


def family_row(family: str, eager: dict[str, Any], cold: dict[str, Any],
               pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The table row of one family: eager's tokens, ascend_dsa's cold run, and the (vLLM default, ascend_dsa warm)
    process pairs run one after the other."""
    defaults, warms = [d for d, _ in pairs], [w for _, w in pairs]
    ratios = [w["throughput"] / d["throughput"] for d, w in pairs]
    return {"family": family,
            "tokens_equal": all(r["tokens"] == eager["tokens"] for r in (cold, *warms)),
            "default_tokens_equal": all(d["tokens"] == eager["tokens"] for d in defaults),
            "backend_graphs": cold["graphs_compiled"],
            "warm_graphs_compiled": max(w["graphs_compiled"] for w in warms),
            "warm_graphs_loaded": min(w["graphs_loaded"] for w in warms),
            "round_ratios": ratios, "throughput_ratio": _median(ratios),
            "default_tok_s": [d["throughput"] for d in defaults], "ascend_dsa_tok_s": [w["throughput"] for w in warms],
            "default_best_tok_s": max(d["throughput"] for d in defaults),
            "ascend_dsa_best_tok_s": max(w["throughput"] for w in warms),
            "ttft_ratio": _median([w["ttft_s"] / d["ttft_s"] for d, w in pairs]),
            "default_init_s": _median([d["init_s"] for d in defaults]), "cold_init_s": cold["init_s"],
            "warm_init_s": _median([w["init_s"] for w in warms]),
            "cold_compile_s": cold["compile_s"], "warm_compile_s": max(w["compile_s"] for w in warms),
            "warm_compile_ratio": max(w["compile_s"] for w in warms) / max(cold["compile_s"], 1e-9)}


def measure_family(family: str, folder: str, pairs: int) -> dict[str, Any]:
    """Eager (the reference tokens), ascend_dsa cold, then `pairs` rounds of vLLM default and ascend_dsa warm
    processes, alternating, so both sides of each round's ratio ran under the same load."""
    from npu_graph.vllm.checkpoints import build_checkpoint

    checkpoint = build_checkpoint(family, os.path.join(folder, family))
    spec = {"folder": checkpoint, "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "rounds": ROUNDS}
    ours, theirs = os.path.join(folder, f"{family}-ascend_dsa"), os.path.join(folder, f"{family}-default")
    eager = serve_in_child({**spec, "mode": "eager"}, theirs)
    cold = serve_in_child({**spec, "mode": "ascend_dsa"}, ours)
    rounds = [(serve_in_child({**spec, "mode": "default"}, theirs),
               serve_in_child({**spec, "mode": "ascend_dsa"}, ours)) for _ in range(pairs)]
    return family_row(family, eager, cold, rounds)


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SystemExit("ascend-dsa bench serve needs vLLM: build its environment with tools/vllm_env.sh DIR "
                         "and run DIR/bin/ascend-dsa bench serve") from None
    from npu_graph.vllm.checkpoints import FAMILIES

    families = FAMILIES[:1] if args.quick else FAMILIES
    rows = []
    with tempfile.TemporaryDirectory(prefix="ascend-dsa-serve-") as folder:
        for family in families:
            with progress.step(f"{family}: vLLM eager, ascend_dsa cold, {PAIRS} rounds of vLLM default "
                                         "and ascend_dsa warm", "bench serve"):
                rows.append(measure_family(family, folder, PAIRS))
    return {"suite": "serve", "rows": rows,
            "notes": [f"{PROMPTS} prompts x {NEW_TOKENS} greedy new tokens, float32, each run a fresh vllm.LLM "
                      "process; throughput is each process's best of "
                      f"{ROUNDS} timed rounds; {PAIRS} rounds of a vLLM default and an ascend_dsa warm process one "
                      "after the other; throughput_ratio and ttft_ratio are the medians of the per-round ratios",
                      "compile_s is vLLM's torch.compile time (Dynamo, compiler, or loading the AOT program)"]}

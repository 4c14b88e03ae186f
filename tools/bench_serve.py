"""`ascend-dsa bench serve`: vLLM serving tiny Llama, Qwen3 and Qwen3-MoE checkpoints, vLLM's default compile vs
ascend_dsa as its compile backend (run in the vLLM environment that tools/vllm_env.sh builds).

For each family a random-weight checkpoint is built from its config in a temporary folder (no downloads), and fresh
`vllm.LLM` processes (npu_graph.vllm.serve_run), one after the other, serve 16 prompts x 64 greedy new tokens (timed
3 times, the best round kept): vLLM eager (the reference tokens), vLLM's default compile, ascend_dsa on empty caches
(cold), and ascend_dsa again on the caches it left (warm). Each process has its own VLLM_CACHE_ROOT per backend, so
vLLM's default compile never reads ours. Row fields: tokens_equal (both ascend_dsa runs gave eager's tokens),
backend_graphs (graphs our backend compiled cold), throughput_ratio (ours warm / vLLM default, new tokens per
second), ttft ratio likewise, warm_compile_ratio (vLLM's torch.compile time warm / cold with ascend_dsa). vLLM's
default compile on CPU is whole-graph Inductor, which vLLM does not time (its default_compile_s reads 0).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from npu_graph.observe import progress

PROMPTS, NEW_TOKENS, ROUNDS = 16, 64, 3


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


def family_row(family: str, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The table row of one family from its runs: eager, default, cold and warm (ascend_dsa)."""
    eager, default, cold, warm = runs["eager"], runs["default"], runs["cold"], runs["warm"]
    return {"family": family,
            "tokens_equal": cold["tokens"] == eager["tokens"] and warm["tokens"] == eager["tokens"],
            "default_tokens_equal": default["tokens"] == eager["tokens"],
            "backend_graphs": cold["graphs_compiled"], "warm_graphs_loaded": warm["graphs_loaded"],
            "default_tok_s": default["throughput"], "ascend_dsa_tok_s": warm["throughput"],
            "throughput_ratio": warm["throughput"] / default["throughput"],
            "ttft_ratio": warm["ttft_s"] / default["ttft_s"],
            "default_compile_s": default["compile_s"], "cold_compile_s": cold["compile_s"],
            "warm_compile_s": warm["compile_s"],
            "warm_compile_ratio": warm["compile_s"] / max(cold["compile_s"], 1e-9)}


def measure_family(family: str, folder: str) -> dict[str, Any]:
    from npu_graph.vllm.checkpoints import build_checkpoint

    checkpoint = build_checkpoint(family, os.path.join(folder, family))
    spec = {"folder": checkpoint, "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "rounds": ROUNDS}
    ours, theirs = os.path.join(folder, f"{family}-ascend_dsa"), os.path.join(folder, f"{family}-default")
    runs = {"eager": serve_in_child({**spec, "mode": "eager"}, theirs),
            "default": serve_in_child({**spec, "mode": "default"}, theirs),
            "cold": serve_in_child({**spec, "mode": "ascend_dsa"}, ours),
            "warm": serve_in_child({**spec, "mode": "ascend_dsa"}, ours)}
    return family_row(family, runs)


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
            with progress.step(f"{family}: vLLM eager, default compile, ascend_dsa cold and warm", "bench serve"):
                rows.append(measure_family(family, folder))
    return {"suite": "serve", "rows": rows,
            "notes": [f"{PROMPTS} prompts x {NEW_TOKENS} greedy new tokens, float32, each run a fresh vllm.LLM "
                      "process; ascend_dsa figures are its warm run",
                      "compile_s is vLLM's torch.compile time (Dynamo, compiler, or loading the AOT program)"]}

"""The memory a DeepSeek-V3.2-sized DSA layer takes while it decodes at long context, measured in a process of its
own (`python -m npu_graph.tools.context_memory CONTEXT [--sizes JSON]`, run by `ascend-dsa bench context`).

The process loads torch, the project and its native kernels, records its resident set (the runtime's own
memory), builds the layer in bf16, fills a bf16 and an FP8 cache of CONTEXT tokens, and decodes a few tokens with
ascend_dsa and ascend_dsa_fp8 (compiled, as bench context's rows are). It prints one JSON line:
`peak_rss_bytes` is the process's peak resident set above the runtime's own (what the layer, its caches, the
compiled steps and their working memory take together), beside `weights_bytes` and `cache_bytes_held` (both
caches), so that a copy of the caches or the weights on any step shows as a peak well above their sum.
A process of its own keeps the other rows of the sweep (eager and Inductor, each with its own buffers) out of it.
Its peak is the kernel's high-water mark of this process (VmHWM), not `getrusage`'s, which Linux carries over
from the parent that started it.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

import torch
from torch._dynamo.utils import counters

import npu_graph.backend  # noqa: F401  (the backend belongs to the runtime's own memory)
from npu_graph.models.cache import HybridCache
from npu_graph.models.context_layer import bf16_context_layer, real_size_config, weights_bytes
from npu_graph.runtime import glue_upgrade
from npu_graph.tools import context_rig
from npu_graph.tools.process_memory import peak_bytes, resident_bytes

STEPS = 3
WARM_BLOCKS = (2, 3)
ROWS = ("ascend_dsa", "ascend_dsa_fp8")


def _decode(steps: dict[str, context_rig.Step], caches: dict[bool, HybridCache], x: torch.Tensor,
            context: int) -> None:
    for row, step in steps.items():
        cache = caches[row in context_rig.FP8_ROWS]
        for _ in range(STEPS):
            cache.lengths.fill_(context)
            step(x, cache)


@torch.no_grad()
def measure(context: int, sizes: dict[str, int]) -> dict[str, Any]:
    """Runtime, compiled, peak and held bytes of the ascend_dsa rows decoding after `context` cached tokens, with
    the layer's `sizes` (DeepSeek-V3.2's where not given)."""
    runtime = resident_bytes()
    torch.manual_seed(0)
    config = real_size_config(context, **sizes)
    layer = bf16_context_layer(config)
    steps = context_rig.row_steps(layer, ROWS)
    x = torch.randn(1, 1, config.hidden_size).bfloat16()
    for blocks in WARM_BLOCKS:      # two short contexts: the second makes the cache's length dimension dynamic
        warm = blocks * config.block_size
        _decode(steps, context_rig.new_caches(config, warm + 1, warm), x, warm)
    glue_upgrade.wait_all()
    compiled = resident_bytes()
    graphs = counters["stats"]["unique_graphs"]
    caches = context_rig.new_caches(config, context + 1, context)
    _decode(steps, caches, x, context)
    own = compiled - weights_bytes(layer)       # interpreter, torch, the project, the compiled rows
    return {"context": context, "runtime_rss_bytes": runtime, "compiled_rss_bytes": own - runtime,
            "peak_rss_bytes": peak_bytes() - own, "process_peak_rss_bytes": peak_bytes(),
            "recompiles_at_context": counters["stats"]["unique_graphs"] - graphs,
            "weights_bytes": weights_bytes(layer),
            "cache_bytes_held": sum(context_rig.held_bytes(c) for c in caches.values())}


def measure_in_new_process(context: int, sizes: dict[str, int], timeout_s: float = 1800) -> dict[str, Any]:
    """`measure` run in a fresh interpreter; its JSON."""
    command = [sys.executable, "-m", "npu_graph.tools.context_memory", str(context), "--sizes", json.dumps(sizes)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"bench context: the memory probe at {context} tokens failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("context", type=int)
    parser.add_argument("--sizes", type=json.loads, default={}, help="layer sizes as JSON (default: real size)")
    args = parser.parse_args()
    print(json.dumps(measure(args.context, args.sizes)))


if __name__ == "__main__":
    main()

"""One `vllm.LLM` process: serve a checkpoint in one compile mode and print what it measured as one JSON line.

    python -m npu_graph.vllm.serve_run '{"folder": ..., "mode": "eager" | "default" | "ascend_dsa", ...}'

Modes: "eager" is vLLM with `enforce_eager=True`; "default" is vLLM's default compile; "ascend_dsa" is vLLM's
compile mode (AOT compile on; one whole-graph piece on CPU, see npu_graph.vllm.plugin) with
`compilation_config={"backend": "ascend_dsa"}`. The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
so that vLLM's own compile time can be read. Printed:
`tokens` (greedy ids per prompt), `init_s` (building the LLM), `compile_s` (vLLM's torch.compile time, Dynamo and
our compiler or the load of the AOT program), `ttft_s` (the batch's time to a first token), `throughput` (new tokens
per second over the batch; both the best of `rounds` timed rounds), `graphs_compiled` / `graphs_loaded` and
`backend_s` (what the ascend_dsa compiler did in this process, from its compile log) and `fused_ops` (the fused
ops in the graphs it compiled). `custom_ops` in the spec enables vLLM's custom ops under compile.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import time
from typing import Any

MODES = ("eager", "default", "ascend_dsa")


def llm_options(mode: str, folder: str, max_num_seqs: int, custom_ops: list[str] | None = None) -> dict[str, Any]:
    """vLLM's `LLM(...)` arguments for `mode` (the checkpoint has no tokenizer: prompts are token ids);
    `custom_ops` (e.g. ["+rms_norm", "+silu_and_mul"]) goes into the compile modes' compilation config."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not a serving mode; choose one of {MODES}")
    options: dict[str, Any] = {"model": folder, "skip_tokenizer_init": True, "dtype": "float32", "seed": 0,
                               "max_model_len": 256, "max_num_seqs": max_num_seqs}
    if mode == "eager":
        options["enforce_eager"] = True
    elif mode == "ascend_dsa":
        options["compilation_config"] = {"backend": "ascend_dsa"}
    if custom_ops and mode != "eager":
        options["compilation_config"] = {**options.get("compilation_config", {}), "custom_ops": list(custom_ops)}
    return options


def compile_events(cache_root: str, pid: int) -> list[dict[str, Any]]:
    """The ascend_dsa compiler's log records (npu_graph.vllm.compiler) written by process `pid` under vLLM's
    cache root."""
    from npu_graph.vllm.compiler import LOG_NAME

    events = []
    for path in glob.glob(os.path.join(cache_root, "**", LOG_NAME), recursive=True):
        with open(path) as f:
            events += [record for record in map(json.loads, f) if record["pid"] == pid]
    return events


def serve(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    count, new_tokens = spec.get("prompts", 4), spec.get("new_tokens", 32)
    from npu_graph.vllm.checkpoints import prompts

    requests = [{"prompt_token_ids": ids} for ids in prompts(count)]
    start = time.perf_counter()
    llm = LLM(**llm_options(spec["mode"], spec["folder"], count, spec.get("custom_ops")))
    init = time.perf_counter() - start
    greedy = dict(temperature=0.0, detokenize=False, ignore_eos=True)
    ttft, seconds = [], []
    for _ in range(spec.get("rounds", 1)):     # the best round: other processes on the machine add noise
        start = time.perf_counter()
        llm.generate(requests, SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
        ttft.append(time.perf_counter() - start)
        start = time.perf_counter()
        outputs = llm.generate(requests, SamplingParams(max_tokens=new_tokens, **greedy), use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    events = compile_events(os.environ["VLLM_CACHE_ROOT"], os.getpid())
    return {"mode": spec["mode"], "tokens": [list(o.outputs[0].token_ids) for o in outputs], "init_s": init,
            "compile_s": llm.llm_engine.vllm_config.compilation_config.compilation_time, "ttft_s": min(ttft),
            "throughput": produced / min(seconds),
            "graphs_compiled": sum(e["event"] == "compile" for e in events),
            "graphs_loaded": sum(e["event"] == "load" for e in events),
            "fused_ops": _merged(e.get("fused_ops", {}) for e in events),
            "backend_s": sum(e["seconds"] for e in events)}


def _merged(counts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for count in counts:
        for name, n in count.items():
            total[name] = total.get(name, 0) + n
    return total


if __name__ == "__main__":
    print("SERVE_RUN " + json.dumps(serve(json.loads(sys.argv[1]))))

"""`ascend-dsa bench e2e`: the reference model's prefill (context 4K, `small`) and decode step (context 16K,
`ctx16k`) in eager, Inductor and ascend_dsa (with its default SuperKernel regions, and without them:
`ascend_dsa_nosk`), timed side by side in one process, with each backend's cold compile time (first call
minus the steady-state median); and a tiny transformers Kimi Linear's prefill (2048 tokens, bench_e2e_kimi)."""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import npu_graph
from npu_graph.kernels.native import dispatch
from npu_graph.models.cache import DSALayerCache, HybridCache
from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.observe import progress
from npu_graph.observe.report import glue_summary
from npu_graph.runtime import glue_upgrade
from npu_graph.tools.bench_e2e_kimi import kimi_prefill_rows
from npu_graph.tools.timing import time_side_by_side

BACKENDS = ("eager", "inductor", "ascend_dsa", "ascend_dsa_nosk")
# A decode step takes ~10-25 ms: many more rounds than a prefill for the same run time, and medians that move
# less with this VM's jitter (~0.5 ms between runs of 15 rounds).
DECODE_ROUNDS = 12


def build_model(config_name: str, seed: int = 0) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(HybridConfig.named(config_name)).eval()


def reset_cache(cache: HybridCache, length: int) -> None:
    """Put the cache back to `length` cached tokens (recurrent states cleared) before a timed call."""
    cache.lengths.fill_(length)
    for layer in cache.layers:
        if not isinstance(layer, DSALayerCache):
            layer.state.zero_()
            layer.conv_state.zero_()


def _own_frame(model: HybridLM) -> Callable[..., Any]:
    """A function calling the model, with a code object of its own. Dynamo keeps compiled entries per code
    object and checks them in turn: compiling `model` itself with several backends in one process makes each
    call of an earlier-compiled backend first evaluate (and fail) the guards of the later ones, ~0.6–0.9 ms a
    call at decode. One frame per backend keeps each backend's lookups its own."""
    namespace: dict[str, Any] = {}
    exec("def step(ids, cache):\n    return model(ids, cache)\n", {"model": model}, namespace)
    return namespace["step"]


def compiled_models(model: HybridLM, ours: dict[str, npu_graph.Backend]) -> dict[str, Callable[..., Any]]:
    return {"eager": model, "inductor": torch.compile(_own_frame(model), backend="inductor"),
            **{name: torch.compile(_own_frame(model), backend=backend) for name, backend in ours.items()}}


class _CountOps(TorchDispatchMode):
    """Counts the operators dispatched while active (an op's own internals are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def dispatched_ops(call: Callable[[], object]) -> int:
    """Number of operators one eager call dispatches (compiled graphs report theirs: GraphReport.ops)."""
    with torch.no_grad(), _CountOps() as counter:
        call()
    return counter.count


def measure_case(name: str, model: HybridLM, ids: torch.Tensor, start: int, repeat: int,
                 warm_cache: Callable[[HybridCache], None] | None = None) -> list[dict[str, Any]]:
    """Cold first call per backend, then all backends alternated; outputs checked against eager."""
    ours = {name: npu_graph.Backend(npu_graph.CompilerConfig.from_options({"cache": False, "superkernel": sk}))
            for name, sk in (("ascend_dsa", True), ("ascend_dsa_nosk", False))}
    models = compiled_models(model, ours)
    caches = {b: model.new_cache(ids.shape[0]) for b in BACKENDS}
    if warm_cache is not None:
        for cache in caches.values():
            warm_cache(cache)
    first_s, outputs = {}, {}
    with torch.no_grad():
        for backend in BACKENDS:
            reset_cache(caches[backend], start)
            t0 = time.perf_counter()
            outputs[backend] = models[backend](ids, caches[backend])
            first_s[backend] = time.perf_counter() - t0

        def runner(backend: str) -> Callable[[], object]:
            def call() -> object:
                reset_cache(caches[backend], start)
                return models[backend](ids, caches[backend])
            return call

        glue_upgrade.wait_all()    # the rounds time the glue ascend_dsa runs once its background compile lands
        dispatch.take_used()
        medians = time_side_by_side({b: runner(b) for b in BACKENDS}, repeat=repeat, warmup=1)
        impl = dispatch.take_used()
        op_counts = {"eager": dispatched_ops(runner("eager")), "inductor": None,
                     **{name: sum(r.ops for r in backend.reports) for name, backend in ours.items()}}
    rows = []
    for backend in BACKENDS:
        err = (outputs[backend] - outputs["eager"]).abs().max().item()
        rows.append({"case": name, "backend": backend, "median_ms": medians[backend] * 1e3,
                     "speedup_vs_eager": medians["eager"] / medians[backend],
                     "speedup_vs_inductor": medians["inductor"] / medians[backend],
                     "cold_compile_s": max(first_s[backend] - medians[backend], 0.0),
                     "ops_dispatched": op_counts[backend],
                     "ops_vs_eager": op_counts[backend] / op_counts["eager"] if op_counts[backend] else None,
                     "max_abs_diff_vs_eager": err,
                     "impl": impl if backend in ours else None,
                     "glue": glue_summary(ours[backend].reports) if backend in ours else None,
                     "superkernels": sum(r.extra.get("superkernels", {}).get("count", 0)
                                         for r in ours[backend].reports) if backend in ours else None})
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch._dynamo.reset()
    prefill_len, decode_ctx = (1024, 4096) if args.quick else (4096, 16384)
    repeat = args.repeat or (3 if args.quick else 5)
    small = build_model("small")
    ids = torch.randint(0, small.config.vocab_size, (1, prefill_len), generator=torch.Generator().manual_seed(1))
    with progress.step(f"prefill {prefill_len} (small)", "bench e2e"):
        rows = measure_case(f"prefill {prefill_len} (small)", small, ids, 0, repeat)
    torch._dynamo.reset()
    long = build_model("ctx16k")
    token = torch.randint(0, long.config.vocab_size, (1, 1), generator=torch.Generator().manual_seed(2))
    with progress.step(f"decode @ {decode_ctx} (ctx16k)", "bench e2e"):
        rows += measure_case(f"decode @ {decode_ctx} (ctx16k)", long, token, decode_ctx - 1,
                             repeat * DECODE_ROUNDS, warm_cache=lambda cache: cache.fill_synthetic_(decode_ctx - 1))
    torch._dynamo.reset()
    with progress.step(f"Kimi Linear prefill {512 if args.quick else 2048}", "bench e2e"):
        rows += kimi_prefill_rows(512 if args.quick else 2048, repeat)
    return {"suite": "e2e", "rows": rows,
            "notes": ["speedups are ratios of medians measured alternately in this run",
                      "cold_compile_s = first call - steady-state median, Dynamo tracing included"]}

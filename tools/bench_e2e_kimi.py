"""`ascend-dsa bench e2e`'s Kimi Linear row: prefill of a tiny random-config transformers `kimi_linear` model
in eager (whose KDA layers run transformers' CPU fallback, a Python loop over chunks and rows), Inductor and
ascend_dsa (where the routed `chunk_kda` runs them), timed side by side, logits compared with eager."""
from __future__ import annotations

import time
from typing import Any

import torch

import npu_graph
from npu_graph.kernels.native import dispatch
from npu_graph.models.tiny_transformers import build_tiny
from npu_graph.runtime import glue_upgrade
from npu_graph.tools.timing import time_side_by_side


def kimi_prefill_rows(length: int, repeat: int) -> list[dict[str, Any]]:
    model = build_tiny("kimi_linear", max_position_embeddings=max(512, 2 * length))
    ids = torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(3))
    ours = npu_graph.Backend(npu_graph.CompilerConfig.from_options({"cache": False}))
    runners = {"eager": model, "inductor": torch.compile(model, backend="inductor"),
               "ascend_dsa": torch.compile(model, backend=ours)}
    with torch.no_grad():
        first, logits = {}, {}
        for name, fn in runners.items():
            start = time.perf_counter()
            logits[name] = fn(ids, use_cache=False).logits
            first[name] = time.perf_counter() - start
        glue_upgrade.wait_all()    # the rounds time the glue ascend_dsa runs once its background compile lands
        dispatch.take_used()
        medians = time_side_by_side({name: (lambda fn=fn: fn(ids, use_cache=False)) for name, fn in runners.items()},
                                    repeat=repeat, warmup=1)
        impl = dispatch.take_used()
    kda = sum(count for r in ours.reports for op, count in r.fused_ops.items() if op == "chunk_kda")
    return [{"case": f"kimi_linear prefill {length} (tiny transformers config)", "backend": name,
             "median_ms": medians[name] * 1e3, "speedup_vs_eager": medians["eager"] / medians[name],
             "speedup_vs_inductor": medians["inductor"] / medians[name],
             "cold_compile_s": max(first[name] - medians[name], 0.0), "ops_dispatched": None, "ops_vs_eager": None,
             "max_abs_diff_vs_eager": (logits[name] - logits["eager"]).abs().max().item(),
             "superkernels": None, "chunk_kda_calls": kda if name == "ascend_dsa" else None,
             "impl": impl if name == "ascend_dsa" else None}
            for name in runners]

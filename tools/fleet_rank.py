"""One process of `ascend-dsa bench fleet`, run as a script under torchrun: it joins the gloo group and answers its
own prompt, or alone (a world of one) every rank's prompt, the first one timed.

`python fleet_rank.py OUT_DIR PROMPTS`: the tiny reference model, run eagerly once, then compiled with ascend_dsa
(torch.compile by the backend's name, as a user writes it). The first compiled call is measured: its wall seconds,
and the CPU-seconds the process spent from torch.compile to that output and then in storing the Dynamo trace it made
for the others, if it did (every thread, and the children it waited for: the C compiler); of those, the CPU-seconds
inside the backend (cache key, lease, load or compile; for a loaded trace, loading its graphs' entries). The rest
is Dynamo's tracing (or the load of a shared trace: npu_graph.cache.traces) and the run. Writes OUT_DIR/<name>.json
with those figures, the graphs' cache decisions and whether the trace was shared, and OUT_DIR/<name>.pt with the
outputs by prompt.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist


def cpu_seconds() -> float:
    """CPU-seconds of this process and of its children that ended."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def prompt(index: int) -> torch.Tensor:
    return torch.randint(3, 250, (1, 24), generator=torch.Generator().manual_seed(1000 + index))


def _timed(method, spent: list[float]):
    """`method`, appending the CPU-seconds of each call to `spent`."""
    def timed(self, *args, **kwargs):
        start = cpu_seconds()
        try:
            return method(self, *args, **kwargs)
        finally:
            spent.append(cpu_seconds() - start)
    return timed


def main(out_dir: str, prompts: int) -> None:
    import npu_graph.backend
    from npu_graph.cache import traces
    from npu_graph.models.hybrid import HybridConfig, HybridLM

    dist.init_process_group("gloo")
    if dist.get_world_size() > 1:
        name, mine = f"rank{dist.get_rank()}", [dist.get_rank()]
    else:
        name, mine = "single", list(range(prompts))
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named("tiny")).eval()
    inside: list[float] = []
    for method in ("__call__", "load_traced_graph"):    # a compile or hit; a graph of a loaded trace
        setattr(npu_graph.backend.Backend, method, _timed(getattr(npu_graph.backend.Backend, method), inside))
    with torch.no_grad():
        model(prompt(mine[0]))
        start_cpu, start = cpu_seconds(), time.perf_counter()
        compiled = torch.compile(model, backend="ascend_dsa")
        outputs = {mine[0]: compiled(prompt(mine[0]))}
        wall = time.perf_counter() - start
        traces.settle()         # the trace this process made for the others is stored
        spent = cpu_seconds() - start_cpu
        outputs.update({index: compiled(prompt(index)) for index in mine[1:]})
    reports = npu_graph.get_backend({}).reports
    record = {"name": name, "first_output_s": wall, "compile_cpu_s": spent, "backend_cpu_s": sum(inside),
              "cache": [report.cache for report in reports],
              "trace": "loaded" if any(r.extra.get("trace") == "shared" for r in reports) else "traced"}
    torch.save(outputs, os.path.join(out_dir, f"{name}.pt"))
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

"""Run by tests/precompile/test_warm_start.py in fresh processes: `MODEL [code]` compiles MODEL with plain
torch.compile(backend="ascend_dsa") and runs it once (with `code`, after loading ascend_dsa it switches torch's
caching precompile on in code). Prints one JSON line: the output's checksum, the frames Dynamo
traced, the graphs Dynamo handed the backend and those loaded with a kept trace, and the seconds from torch.compile to
the end of the first call."""
import json
import sys
import time

import torch
import torch._dynamo

import npu_graph
from npu_graph.cache import traces


class BrokenMLP(torch.nn.Module):
    """Two graphs: a graph break between them, as a print or a data-dependent branch would make."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        y = torch.nn.functional.silu(self.up(x))
        torch._dynamo.graph_break()
        return self.down(y).softmax(-1)


def build(name):
    torch.manual_seed(0)
    if name == "hybrid":
        from npu_graph.models.hybrid import HybridConfig, HybridLM
        model = HybridLM(HybridConfig.named("tiny")).eval()
        ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
        return model, lambda m: m(ids, model.new_cache(1))
    model, x = BrokenMLP().eval(), torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    return model, lambda m: m(x)


def main(name, switch="env"):
    model, call = build(name)
    if switch == "code":
        npu_graph.get_backend({})
        torch._dynamo.config.caching_precompile = True
    with torch.no_grad():
        start = time.perf_counter()
        out = call(torch.compile(model, backend="ascend_dsa"))
        seconds = time.perf_counter() - start
        eager = call(model)
    traces.settle()
    reports = npu_graph.get_backend({}).reports
    print(json.dumps({"sum": float(out.double().sum()), "eager": float(eager.double().sum()),
                      "traced": torch._dynamo.utils.counters["frames"]["total"],
                      "from_dynamo": sum(r.extra.get("trace") != "shared" for r in reports),
                      "loaded": sum(r.extra.get("trace") == "shared" for r in reports), "seconds": seconds}))


if __name__ == "__main__":
    main(*sys.argv[1:])

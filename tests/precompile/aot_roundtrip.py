"""Run by tests/precompile/test_aot_compile.py in fresh processes: `save PATH MODEL` AOT-compiles MODEL with ascend_dsa
and saves the program; `load PATH MODEL` loads it and runs it. Each prints one JSON line: the logits' checksum, the
graphs Dynamo traced and the backend compiled in this process, and the first call's seconds."""
import json
import sys
import time

import torch

import npu_graph
from npu_graph.models.hybrid import HybridConfig, HybridLM


class SmallMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(32, eps=1e-6)
        self.up = torch.nn.Linear(32, 128, bias=False)
        self.down = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x):
        gate, up = self.up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(gate) * up)


def build(name):
    torch.manual_seed(0)
    if name == "hybrid":
        model = HybridLM(HybridConfig.named("tiny")).eval()
        ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
        return model, (ids, model.new_cache(1))
    return SmallMLP().eval(), (torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3)),)


def main(action, path, name):
    model, args = build(name)
    backend = npu_graph.get_backend({"verify": False})
    start = time.perf_counter()
    with torch.no_grad():
        if action == "save":
            compiled = torch.compile(model, backend=backend, fullgraph=True,
                                     options={"guard_filter_fn": torch.compiler.keep_portable_guards_unsafe})
            program = compiled.forward.aot_compile((args, {}))
            program.save_compiled_function(path)
        else:
            from torch._dynamo.aot_compile import AOTCompiledFunction
            with open(path, "rb") as f:
                program = AOTCompiledFunction.deserialize(f.read(), f_globals=type(model).forward.__globals__)
        out = program(model, *args)
        seconds = time.perf_counter() - start
        eager = model(*build(name)[1])
    traced = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(json.dumps({"sum": float(out.double().sum()), "eager": float(eager.double().sum()),
                      "traced": traced, "compiled": len(backend.reports), "seconds": seconds}))


if __name__ == "__main__":
    main(*sys.argv[1:])

"""NPU target: generate the torch_npu program for a graph, check it, dump it, and run it where torch_npu is.

`lower` always builds both program forms (npu_program.generate), validates every torch_npu / torchair call
against the pinned table (npu_contract) and writes `npu_program.py` (eager torch_npu) and
`npu_program_torchair.py` (torchair graph mode: torchair's "reduce-overhead" aclgraph mode under torch.compile's
mode="reduce-overhead", else its default "max-autotune" GE mode; `torchair_mode`) into the dump. With
torch_npu importable it returns the program as a CompiledGraph (torchair form when torchair is importable too);
without it, it returns None so the caller runs the CPU program, and warns once (NpuProgramNotExecutedWarning).
torch_npu is imported nowhere else.
"""
from __future__ import annotations

import importlib.util
import os
import threading
import warnings
from typing import Any

import torch.fx

from npu_graph.runtime.compiled_graph import CompiledGraph
from npu_graph.targets.cpu import attribute_plan
from npu_graph.targets.npu_contract import check_calls
from npu_graph.targets.npu_program import NpuProgram, generate

PROGRAM_FILES = {"eager": "npu_program.py", "torchair": "npu_program_torchair.py"}


class NpuProgramNotExecutedWarning(UserWarning):
    """target="npu" on a machine without torch_npu: the NPU program was generated but the CPU program runs."""


_warned = threading.Event()


def available(module: str = "torch_npu") -> bool:
    """Whether `module` can be imported here (torch_npu, torchair), without importing it."""
    return importlib.util.find_spec(module) is not None


def torchair_mode(mode: str) -> str:
    """torchair's graph mode for a torch.compile mode: "reduce-overhead" (aclgraph) or its default "max-autotune"."""
    return "reduce-overhead" if mode == "reduce-overhead" else "max-autotune"


def build(gm: torch.fx.GraphModule, name: str, graph_mode: str = "max-autotune") -> NpuProgram:
    """The checked NPU program for a final pipeline graph (gm is not modified)."""
    program = generate(gm, name, graph_mode)
    check_calls(program.calls + program.scope_calls)
    return program


def _warn_once() -> None:
    if _warned.is_set():
        return
    _warned.set()
    warnings.warn("ascend_dsa: target='npu' but torch_npu is not installed: the NPU program was generated and "
                  "written to the dump (npu_program.py) but not executed; the CPU program runs instead. Install "
                  "torch_npu (see docs/npu.md) to run it.", NpuProgramNotExecutedWarning, stacklevel=3)


def _write(program: NpuProgram, dump: Any) -> str | None:
    if dump is None:
        return None
    for mode, filename in PROGRAM_FILES.items():
        dump.write_text(filename, program.sources[mode])
    return os.path.join(dump.folder, PROGRAM_FILES["eager"])


def lower(gm: torch.fx.GraphModule, name: str, dump: Any = None, graph_mode: str = "max-autotune"
          ) -> tuple[CompiledGraph | None, dict[str, Any]]:
    """(the NPU CompiledGraph, or None without torch_npu; the report's "npu_program" section)."""
    program = build(gm, name, graph_mode)
    summary = {"path": _write(program, dump), **program.summary(), "torchair_mode": graph_mode}
    if not available("torch_npu"):
        _warn_once()
        return None, summary
    mode = "torchair" if available("torchair") else "eager"
    summary.update(executed=True, mode=mode)
    compiled = CompiledGraph(name, program.sources[mode], {}, attribute_plan(gm), program.nz_inputs)
    return compiled, summary

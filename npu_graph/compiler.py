"""compile_graph: one captured ATen graph -> pipeline -> target lowering -> CompiledGraph, with its report
and dump. Every step is named so a failure says where it happened."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch.fx

from npu_graph.config import CompilerConfig
from npu_graph.observe.dump import GraphDump
from npu_graph.observe.implementations import implementations
from npu_graph.observe.report import GraphReport, fused_op_counts, op_count
from npu_graph.observe.trace import traced_dump
from npu_graph.parallel.ep_report import expert_parallel_summary
from npu_graph.pass_api import GraphInputs, MetaKey, PassContext
from npu_graph.pipeline import run_pipeline
from npu_graph.runtime.compiled_graph import CompiledGraph
from npu_graph.targets import cpu, npu
from npu_graph.targets.description import describe


class CompileStepError(RuntimeError):
    """Compilation failed in a named step (a pass name, "lower", ...)."""

    def __init__(self, step: str, cause: BaseException):
        super().__init__(f"step {step!r} failed: {type(cause).__name__}: {cause}")
        self.step = step


def _graph_device(gm: torch.fx.GraphModule) -> str:
    """The device of the graph's first tensor (the profile and stream switches follow it), else "cpu"."""
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            return str(value.device)
    return "cpu"


def _fake_mode(example_inputs: Sequence[Any]) -> Any:
    return torch._guards.detect_fake_mode(list(example_inputs))


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: CompilerConfig,
                  report: GraphReport, inputs: GraphInputs | None = None) -> CompiledGraph:
    """Run the pipeline on an AOT graph and lower it; fills `report` and writes the stage dumps (the
    caller writes summary.json once the cache decision is known). `inputs.param_indices` are the inputs that are
    model parameters: work that reads only them is hoisted into a prologue (npu_graph.runtime.hoist)."""
    inputs = inputs or GraphInputs()
    param_indices = inputs.param_indices
    start = time.perf_counter()
    dump = GraphDump.create(config.debug.graph_dump.path, report.name) if config.debug.graph_dump.path \
        else None
    dump = traced_dump(dump, report.name)
    report.dump_folder = dump.folder if dump else None
    report.nodes_before = len(gm.graph.nodes)
    for node in gm.graph.nodes:
        node.meta.setdefault(MetaKey.CREATED_BY, "capture")
    if dump:
        dump.write_stage(0, "captured", gm, {})
    ctx = PassContext(config=config, machine=describe(config.target, _graph_device(gm)), inference=report.inference,
                      fake_mode=_fake_mode(example_inputs), dump=dump, graph_name=report.name,
                      param_indices=tuple(param_indices), float_inputs=dict(inputs.float_inputs))
    try:
        records = run_pipeline(gm, ctx)
    except Exception as exc:
        raise CompileStepError(getattr(exc, "pass_name", "pipeline"), exc) from exc
    report.passes = [r.to_json() for r in records]
    for record in records:
        report.extra.update(record.summary)
    report.timings_ms["passes"] = sum(r.ms for r in records)
    lower_start = time.perf_counter()
    try:
        placeholders = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
        hoist = param_indices if placeholders == len(example_inputs) else ()
        npu_compiled = None
        if config.target == "npu":
            npu_compiled, report.extra["npu_program"] = npu.lower(gm, report.name, dump,
                                                                  npu.torchair_mode(config.mode))
        compiled = npu_compiled or cpu.lower(gm, report.name, hoist, config.experimental_config.frozen_parameter,
                                             config.cpu.glue)
    except Exception as exc:
        raise CompileStepError("lower", exc) from exc
    report.timings_ms["lower"] = (time.perf_counter() - lower_start) * 1e3
    report.nodes_after = len(gm.graph.nodes)
    report.fused_ops = fused_op_counts(gm)
    if ep_layers := expert_parallel_summary(gm):
        report.extra["expert_parallel"] = ep_layers
    if npu_compiled is None:
        report.extra["implementations"] = implementations(gm)
    report.ops = op_count(gm)
    report.extra["runtime"] = {"mode": config.mode, "prologue": compiled._prologue is not None,
                               "prologue_parameters": len(compiled.param_indices),
                               "frozen_parameters": compiled.frozen_parameters, "glue": compiled.glue,
                               "glue_reason": compiled.glue_reason}
    report.timings_ms["compile"] = (time.perf_counter() - start) * 1e3
    if dump:
        dump.write_text("compiled.py", compiled.source)
    if getattr(compiled, "glue_upgrade", None) is not None:
        compiled.upgrade_listeners.append(lambda graph: _glue_landed(graph, report, dump))
    return compiled


def _glue_landed(compiled: Any, report: GraphReport, dump: GraphDump | None) -> None:
    """A background glue compile landed (npu_graph.runtime.glue_upgrade): the report and the dump say what runs."""
    report.extra["runtime"].update(glue=compiled.glue, glue_reason=compiled.glue_reason,
                                   glue_calls_before=compiled.glue_calls_before)
    if dump:
        dump.write_text("compiled.py", compiled.source)

"""The `ascend_dsa` torch.compile backend.

`torch.compile(model, backend="ascend_dsa", options={...})` reaches `ascend_dsa` through the
`torch_dynamo_backends` entry point (npu_graph.backend_entry, which starts the native builds ahead);
torch.compile's `mode=` reaches it too (CompilerConfig.mode).
`get_backend(config)` (or torchair's spelling `get_backend(compiler_config=config)`) returns one Backend per
distinct config, so a second torch.compile with the same backend object reuses Dynamo's compiled code. A
`mode=` or `options=` given to torch.compile together with a Backend object is applied on top of its config
(a one-time warning says so for options). Configuration errors always raise.

If compiling a graph fails, the graph runs eagerly and one warning names the failing step (with
strict=True the error is raised instead).

Importing this module (what resolving `backend="ascend_dsa"` does, before Dynamo traces anything) installs the
kernel routes (npu_graph.routes); `import npu_graph` alone changes nothing in other libraries.
"""
from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx

from npu_graph.cache import traces
from npu_graph.cache.entry import Artifact
from npu_graph.cache.key import Uncacheable
from npu_graph.cache.manager import CompileCache, Lookup, make_artifact, with_code
from npu_graph.cache.precompiled import PrecompiledGraph
from npu_graph.capture import capture_and_compile, float_inputs, restart_request
from npu_graph.compiler import CompileStepError, compile_graph
from npu_graph.config import CompilerConfig, ConfigError, resolve_option
from npu_graph.kernels.checks import FusedPreconditionError
from npu_graph.kernels.native import prebuild as native_prebuild
from npu_graph.observe.dump import GraphDump, current_compile_id, dump_matches_entry
from npu_graph.observe.implementations import refreshed_after_first_call
from npu_graph.observe.report import GraphReport
from npu_graph.observe.trace import log_code
from npu_graph.observe.verify import verified
from npu_graph.parallel.ep_report import for_this_rank
from npu_graph.parallel.rank_free import make_rank_free
from npu_graph.pass_api import GraphInputs
from npu_graph.routes import install_routes
from npu_graph.runtime import inductor_glue
from npu_graph.runtime.glue_upgrade import GlueUpgrade

log = logging.getLogger("npu_graph")
install_routes()


class CompilationFallbackWarning(UserWarning):
    """A graph could not be compiled and runs eagerly instead."""


class OptionsMergedWarning(UserWarning):
    """torch.compile's `options=` were applied on top of the config of a get_backend() object."""


class Backend:
    """A Dynamo backend bound to one CompilerConfig; keeps a report per compiled graph."""

    def __init__(self, config: CompilerConfig):
        self.config = config
        self.reports: list[GraphReport] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.cache = CompileCache(config)
        self._merged_warned: set[tuple[str, ...]] = set()

    def __repr__(self) -> str:
        return f"ascend_dsa.Backend(target={self.config.target!r}, graphs={len(self.reports)})"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                 options: dict[str, Any] | None = None) -> Callable[..., Any]:
        if mode is not None or options:
            return self.with_settings(mode, options)(gm, example_inputs)
        with self._lock:
            name = f"graph_{next(self._ids)}"
        start = time.perf_counter()
        try:
            compiled = self._compile_or_load(gm, list(example_inputs), name)
        except ConfigError:
            raise
        except Exception as exc:
            restart = restart_request(exc)
            if restart is not None:     # Dynamo traces the frame again, with the floats asked for as constants
                raise restart from None
            return self._fall_back(gm, name, exc)
        log.info("ascend_dsa: %s ready in %.1f ms", name, (time.perf_counter() - start) * 1e3)
        compiled.run = eager_on_precondition_failure(name, compiled.run, gm.forward, self.config.strict)
        if self.config.verify.enabled:
            v = self.config.verify
            compiled.run = verified(name, gm.forward, compiled.run, v.atol, v.rtol, self.config.strict)
        return compiled

    def load_traced_graph(self, key: str, eager: Callable[..., Any]) -> Callable[..., Any] | None:
        """The graph stored as cache entry `key`, for a trace loaded whole (npu_graph.cache.traces): Dynamo did not
        trace, so there is no graph in hand; `eager` runs Dynamo's graph, for a fused op's failed precondition.
        None when the entry cannot be loaded (the trace is then not used)."""
        found = self.cache.load_entry(key)
        if found is None:
            return None
        with self._lock:
            name = f"graph_{next(self._ids)}"
        report = GraphReport.from_summary(name, found.summary, cache="hit")
        report.extra.update(found.provenance(None), trace="shared")
        self._add_report(report)
        log_code(name, f"loaded from cache entry {key[:12]}, its frame from a shared trace", found.source)
        return eager_on_precondition_failure(name, found.callable, eager, self.config.strict)

    def with_settings(self, mode: str | None, options: dict[str, Any] | None) -> Backend:
        """The Backend for this config with torch.compile's `mode` / `options` applied on top (they win)."""
        config = copy.deepcopy(self.config)
        for key, value in (options or {}).items():
            config.set(resolve_option(key), value)
        if mode is not None:
            config.mode = mode
        config.validate()
        keys = tuple(sorted(options or ()))
        if keys and keys not in self._merged_warned:
            self._merged_warned.add(keys)
            warnings.warn(f"ascend_dsa: torch.compile options {list(keys)} were applied on top of the config of "
                          f"the backend object from get_backend() (options win); pass them to get_backend() to "
                          f"keep one place for settings", OptionsMergedWarning, stacklevel=3)
        return get_backend(config)

    def _compile_or_load(self, gm: torch.fx.GraphModule, example_inputs: list[Any], name: str
                         ) -> PrecompiledGraph:
        rank_free = 0
        if self.config.target == "cpu":     # ranks whose graphs differ only by their groups share one entry
            rank_free = make_rank_free(gm)
            if rank_free:
                traces.graph_not_shared()
        with self.cache.lookup(gm, example_inputs) as found:
            if found.decision == "hit" and not rank_free:   # a trace holding this graph can be shared
                traces.record_graph(gm, found.key)
            if found.decision == "hit" and found.summary.get("runtime", {}).get("glue") == "inductor":
                # a process served from the cache: the check an entry with Inductor's glue needs overlaps the tracing
                # of the graphs after it (a compile starts it where its lowering picks Inductor's glue, after the
                # native builds its first graph waits for); a process whose entries all run their Python glue (a
                # fleet's ranks loading what one of them just compiled) never pays for it
                inductor_glue.warm_vec_isa()
            if found.decision == "hit" and not self.config.debug.graph_dump.path:
                report = GraphReport.from_summary(name, found.summary, cache="hit")
                if "expert_parallel" in report.extra:
                    report.extra["expert_parallel"] = for_this_rank(report.extra["expert_parallel"])
                report.extra.update(found.provenance(current_compile_id()))
                self._add_report(report)
                log_code(name, f"loaded from cache entry {found.key[:12]}", found.source)
                return PrecompiledGraph(found.callable, name, found.artifact, key=found.key)
            sink: dict[str, Any] = {}
            params = tuple(i for i, x in enumerate(example_inputs) if isinstance(x, torch.nn.Parameter))
            inputs = GraphInputs(params, float_inputs(gm))
            with native_prebuild.building_ahead():
                compiled = capture_and_compile(gm, example_inputs, self._graph_compiler(name, sink, inputs),
                                               self.config.experimental_config.keep_inference_input_mutations)
            reports = sink["reports"]
            decision, reason = found.decision, found.reason
            if decision == "hit":  # compiled again only for the dump (docs/cache.md): the entry runs
                compiled = found.callable
                precompiled = PrecompiledGraph(compiled, name, found.artifact)
                if self._glue_pending(sink):         # the glue the entry holds, when a background compile gave it
                    sink["graphs"][0].finish_glue()
                dump_matches_entry(reports[0], sink["graphs"][0].source, found.source)
            else:   # made without the cache too (disabled): the precompiled program serializes it
                artifact, why_not = self._artifact(gm, example_inputs, sink, found.guard_count)
                precompiled = PrecompiledGraph(compiled, name, artifact, why_not)
            if decision == "miss":
                decision, reason = self._store(found, example_inputs, artifact, reports, why_not or reason)
                if decision == "miss" and not rank_free:
                    traces.record_graph(gm, found.key)
                if decision == "miss" and self._glue_pending(sink):
                    # stored now with the Python glue, while this process holds the entry's lease, so that other
                    # processes waiting for it load it; replaced by the glue that then runs once it lands, which the
                    # precompiled program then serializes too
                    upgrade = sink["graphs"][0].glue_upgrade
                    upgrade.on_landed.append(lambda landed: self._store_landed(
                        found, example_inputs, artifact, landed, reports, precompiled))
                    reason = f"{reason}; replaced once the background glue compile lands"
            origin = f"loaded from cache entry {found.key[:12]}" if decision == "hit" else f"compiled, cache {decision}"
            for report, graph in zip(reports, sink["graphs"]):
                report.cache, report.cache_reason = decision, reason
                report.extra.update(found.provenance(current_compile_id()))
                log_code(report.name, origin, found.source if decision == "hit" else graph.source)
            self._write_summaries(reports)
            if self._glue_pending(sink):
                sink["graphs"][0].upgrade_listeners.append(lambda _: self._write_summaries(reports))
            if reports[0].dump_folder:
                entries = reports[0].extra.get("implementations", [])
                compiled = refreshed_after_first_call(compiled, entries, lambda: self._write_summaries(reports))
            precompiled.run = compiled
            precompiled.key = found.key if decision in ("hit", "miss") else None
            return precompiled

    @staticmethod
    def _glue_pending(sink: dict[str, Any]) -> bool:
        return len(sink["graphs"]) == 1 and getattr(sink["graphs"][0], "glue_upgrade", None) is not None

    def _store(self, found: Lookup, example_inputs: list[Any], artifact: Artifact | None,
               reports: list[GraphReport], reason: str, runtime: dict[str, Any] | None = None) -> tuple[str, str]:
        """Store a compiled miss (or record why not: `reason`); the cache decision and reason. `runtime` (the
        code that runs once a background glue compile landed) replaces the report's runtime settings in the
        entry's summary, and the entry stored before."""
        summary = {k: v for k, v in reports[0].to_json().items() if k not in ("cache", "cache_reason")}
        if runtime is not None:
            summary["runtime"] = runtime
        replace = runtime is not None
        return self.cache.store(found, example_inputs, artifact, summary, reason, replace=replace), reason

    def _store_landed(self, found: Lookup, example_inputs: list[Any], artifact: Artifact, upgrade: GlueUpgrade,
                      reports: list[GraphReport], precompiled: PrecompiledGraph) -> None:
        """Store again a miss whose background glue compile has landed (on the worker's thread), with the code the
        graph runs from its next call on, which `precompiled` serializes from now on."""
        runtime = {**reports[0].extra.get("runtime", {}), "glue_reason": upgrade.reason}
        if (ready := upgrade.ready) is not None:
            try:
                artifact = with_code(artifact, ready["source"], ready["globals_"], ready["attributes"], upgrade.guards)
                runtime["glue"] = ready["glue"]
            except Uncacheable as exc:      # the entry keeps the Python glue, which needs no more guards
                runtime["glue_reason"] += f"; the cache entry keeps the Python glue ({exc})"
        precompiled.artifact = artifact
        self._store(found, example_inputs, artifact, reports, "", runtime)

    @staticmethod
    def _write_summaries(reports: list[GraphReport]) -> None:
        for report in reports:
            if report.dump_folder:
                GraphDump(report.dump_folder).write_summary(report.to_json())

    @staticmethod
    def _artifact(gm: torch.fx.GraphModule, example_inputs: list[Any], sink: dict[str, Any], guard_start: int
                  ) -> tuple[Artifact | None, str]:
        if len(sink["graphs"]) != 1:
            return None, "more than one graph"
        try:
            return make_artifact(gm, example_inputs, sink["graphs"][0], guard_start), ""
        except Uncacheable as exc:
            return None, str(exc)

    def _graph_compiler(self, name: str, sink: dict[str, Any], graph_inputs: GraphInputs) -> Callable[..., Any]:
        parts = itertools.count()
        sink["reports"], sink["graphs"] = [], []

        def compile_one(gm: torch.fx.GraphModule, inputs: Sequence[Any], inference: bool) -> Any:
            part = next(parts)
            suffix = "" if inference and part == 0 else f"_{'inference' if inference else 'autograd'}{part}"
            report = GraphReport(name=name + suffix, inference=inference, target=self.config.target)
            compiled = compile_graph(gm, inputs, self.config, report, graph_inputs if inference else GraphInputs())
            sink["reports"].append(report)
            sink["graphs"].append(compiled)
            self._add_report(report)
            return compiled

        return compile_one

    def _add_report(self, report: GraphReport) -> None:
        with self._lock:
            self.reports.append(report)

    def _fall_back(self, gm: torch.fx.GraphModule, name: str, exc: Exception) -> Callable[..., Any]:
        step = exc.step if isinstance(exc, CompileStepError) else "capture"
        if self.config.strict:
            raise exc
        message = (f"ascend_dsa: compiling {name} failed in step '{step}' ({type(exc).__name__}: {exc}); "
                   f"this graph runs eagerly. Set options={{'strict': True}} to raise instead.")
        warnings.warn(message, CompilationFallbackWarning, stacklevel=2)
        self._add_report(GraphReport(name=name, inference=not torch.is_grad_enabled(), target=self.config.target,
                                     fallback=step))
        return gm.forward


def eager_on_precondition_failure(name: str, compiled: Callable[..., Any], eager: Callable[..., Any],
                                  strict: bool) -> Callable[..., Any]:
    """Run `compiled`; if a fused op reports at run time that its inputs break what the fusion assumed,
    warn once and run this graph eagerly from then on (inputs are untouched: in-place updates of graph
    inputs happen at the end of the graph)."""
    state = {"eager": False}

    def run(*args: Any) -> Any:
        if state["eager"]:
            return eager(*args)
        try:
            return compiled(*args)
        except FusedPreconditionError as exc:
            if strict:
                raise
            state["eager"] = True
            warnings.warn(f"ascend_dsa: {name}: {exc}; this graph runs eagerly from now on",
                          CompilationFallbackWarning, stacklevel=2)
            return eager(*args)

    return run


_BACKENDS: dict[str, Backend] = {}
_BACKENDS_LOCK = threading.Lock()


def get_backend(config: CompilerConfig | dict[str, Any] | None = None, *,
                compiler_config: CompilerConfig | dict[str, Any] | None = None) -> Backend:
    """The Backend for this config: a CompilerConfig (validated, and copied: later edits of the object do not
    reach the backend) or a dict of options; `compiler_config=` is torchair's spelling of the same argument.
    Equal configs share one object."""
    if config is not None and compiler_config is not None:
        raise ConfigError("get_backend: pass the config once, either positionally or as compiler_config=")
    config = compiler_config if config is None else config
    if isinstance(config, CompilerConfig):
        config = config.checked()
    elif config is None or isinstance(config, dict):
        config = CompilerConfig.from_options(config)
    else:
        raise ConfigError(f"get_backend takes a CompilerConfig or a dict of options, not {type(config).__name__}")
    key = config.key()
    with _BACKENDS_LOCK:
        if key not in _BACKENDS:
            _BACKENDS[key] = Backend(config)
        return _BACKENDS[key]


def backend_compiling(callback: Any) -> Backend | None:
    """The Backend a torch.compile callback compiles with (torch.compile(backend="ascend_dsa", options=...,
    mode=...) or a Backend object), None for another backend or settings that do not validate."""
    inner = torch._dynamo.eval_frame.innermost_backend(callback) if callback is not None else None
    kwargs = getattr(inner, "kwargs", None) or {}
    compiler = getattr(inner, "compiler_fn", inner)
    try:
        if compiler is ascend_dsa:
            return get_backend(CompilerConfig.from_options(kwargs.get("options"), mode=kwargs.get("mode")))
        if isinstance(compiler, Backend):
            return compiler.with_settings(kwargs.get("mode"), kwargs.get("options")) if kwargs else compiler
    except ConfigError:
        return None
    return None


def ascend_dsa(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
               options: dict[str, Any] | None = None, mode: str | None = None) -> Callable[..., Any]:
    """Dynamo entry point (`backend="ascend_dsa"`): torch.compile passes `options` or `mode`, never both."""
    return get_backend(CompilerConfig.from_options(options, mode=mode))(gm, example_inputs)


traces.install(backend_compiling)

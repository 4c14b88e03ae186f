"""Inductor as the CPU lowering's code generator for the work between fused ops.

After the passes, a decode graph of a small model is ~40 fused-op calls and ~150 small ATen calls (views, cats,
slices, a few elementwise ops). Run as one Python call per node, those ATen calls cost more than the math (the
tiny DeepSeek-V3.2's decode step: ~190 calls). Inductor turns them into a few generated C++ loops and views
that cost nothing (`reinterpret_tensor`), and calls what it does not lower (our fused ops, topk) as fallbacks.

`compile_forward` hands the graph to Inductor's `compile_fx` with the graph's own fake inputs, inside the compile
in progress, so a symbolic graph stays symbolic and any guard Inductor adds reaches Dynamo. AOT autograd traces it
again with Inductor's decompositions, to which the elementwise fused ops (rms_norm, add_rms_norm, rotary_mul) are
added as their reference formulas: Inductor fuses them into its loops. The other fused ops stay opaque calls.
Only Inductor's generated module is kept, so a graph whose AOT metadata needs AOT autograd's runtime wrapper
(input mutations outside the graph, outputs rebuilt from inputs) is refused (GlueUnsupported). Inductor's kernels
run on one thread: a decode graph's loops are tiny, and an OpenMP team woken between fused ops costs more. The
module checks no input's sizes and strides (`size_asserts` off: ~60 `assert_size_stride` calls a tiny decode
step, ~1 µs each): its inputs are the graph's, whose sizes and strides Dynamo's guards check before every call,
and the prologue's, which this runtime builds with the layout they were traced with.
The result is Inductor's module source with a `forward(self, *inputs)` adapter, which gives every output the
layout the graph traced (npu_graph.runtime.glue_layouts). The CPU lowering binds that
source's fused-op and ATen calls as it binds its own (npu_graph.targets.cpu_bindings): a fused op is called as its
implementation, not through the dispatcher (`torch.ops.ascend_dsa.<op>.default` costs ~20-35 us a call more), so
the source in the dump is what runs. Inductor's on-disk caches serve a graph compiled before; the generated source
carries the C++ of its kernels, so a compile-cache entry holding it is self-contained.
"""
from __future__ import annotations

import re
import threading
from statistics import median

import torch
import torch.fx
from torch import Tensor

from npu_graph.kernels.rowwise.rms_norm import reference_add_rms_norm, reference_rms_norm
from npu_graph.kernels.rowwise.rotary_mul import reference_rotary_mul
from npu_graph.passes.streams.cost_model import numel
from npu_graph.runtime import glue_layouts

# "auto" gives the glue to Inductor when a graph has at least MIN_GLUE_NODES ATen calls and half of them produce at
# most SMALL_NODE_ELEMENTS values (decode-sized work, where a call's Python dispatch costs more than its math); a
# prefill's glue does real work per call, and the Python form saves Inductor's compile time. 32: tiny qwen3_moe's
# graphs have 50-56 calls and llama's prefill 62, whose Python glue cost them 0.7-0.9x Inductor's speed under 64.
MIN_GLUE_NODES = 32
SMALL_NODE_ELEMENTS = 8192
# ... and compiles it with the graph (not in the background) for a symbolic graph of at least NOW_MIN_GLUE_NODES
# calls. Tiny decode graphs on the 2-core Zen 4: deepseek_v32's 155 calls ran generate() at 40.0 ms with the
# Python glue, 29-30 ms with Inductor's (Inductor: 32.4-32.7 ms), so the rounds right after a first generate()
# were 0.88x Inductor's speed until a background compile landed; llama's 68 calls 26.4 vs 22.2 ms and qwen3_moe's
# 54 calls 30.6 vs 27.3 ms, where the compile's ~9 s would double a first generate() of ~8 s.
NOW_MIN_GLUE_NODES = 96

_AOT_ID = re.compile(r"^# AOT ID: .*\n", re.MULTILINE)


class GlueUnsupported(ValueError):
    """The graph cannot run as Inductor's module alone (the reason says why); the Python form runs it."""


# Outputs Inductor's module returns as the graph does: no view that AOT autograd's runtime would rebuild from an
# input, and no extra base tensor among the outputs.
_PLAIN_OUTPUTS = ("non_alias", "alias_of_intermediate", "alias_of_intermediate_base_is_user_output",
                  "unsafe_view_alias")


def _check_plain(meta: object) -> None:
    """Raise GlueUnsupported unless AOT autograd's runtime wrapper around Inductor's `call` would do nothing:
    input mutations kept in the graph, no outputs regenerated from inputs, no extra outputs or effect tokens."""
    if meta is None:
        raise GlueUnsupported("AOT autograd gave no view and mutation metadata")
    if meta.num_mutated_inp_runtime_indices or meta.num_intermediate_bases or meta.tokens:
        raise GlueUnsupported("the graph has input mutations, intermediate bases or effect tokens that AOT "
                              "autograd's runtime wrapper applies outside Inductor's module")
    kinds = {info.output_type.name for info in meta.output_info}
    if not kinds <= set(_PLAIN_OUTPUTS):
        raise GlueUnsupported(f"outputs of kind {sorted(kinds - set(_PLAIN_OUTPUTS))} are rebuilt by AOT "
                              "autograd's runtime wrapper")


def _aten_result_sizes(gm: torch.fx.GraphModule) -> list[int]:
    values = [node.meta.get("val") for node in gm.graph.nodes
              if node.op == "call_function" and getattr(node.target, "namespace", None) == "aten"]
    return [numel(value) for value in values if isinstance(value, torch.Tensor)]


def worth_compiling(gm: torch.fx.GraphModule) -> tuple[bool, str]:
    """Whether "auto" gives gm's glue to Inductor (MIN_GLUE_NODES, SMALL_NODE_ELEMENTS), and why."""
    sizes = _aten_result_sizes(gm)
    if len(sizes) < MIN_GLUE_NODES:
        return False, f"{len(sizes)} ATen calls (< {MIN_GLUE_NODES})"
    middle = median(sizes)
    if middle > SMALL_NODE_ELEMENTS:
        return False, f"median ATen result of {middle:.0f} values (> {SMALL_NODE_ELEMENTS}): the calls do real work"
    return True, f"{len(sizes)} ATen calls, median result {middle:.0f} values (<= {SMALL_NODE_ELEMENTS})"


def compile_now(gm: torch.fx.GraphModule) -> bool:
    """Whether "auto" compiles the glue of gm (worth compiling) with the graph rather than in the background: its
    sizes are symbolic (`symbolic_inputs`: the graph of every later decode step) and its Python glue makes at least
    NOW_MIN_GLUE_NODES ATen calls a step."""
    return symbolic_inputs(gm) and len(_aten_result_sizes(gm)) >= NOW_MIN_GLUE_NODES


_VEC_ISA_CHECK: list[threading.Thread] = []
GLUE_LINE = "GLUE = 'inductor'\n"     # the setting a source with Inductor's glue starts with (targets.cpu)


def _check_vec_isa() -> None:
    from torch._inductor import cpu_vec_isa
    try:
        cpu_vec_isa.valid_vec_isa_list()
    except Exception:       # the compile that needs the list computes it again and reports what fails
        cpu_vec_isa.valid_vec_isa_list.cache_clear()


def vec_isa_checked() -> None:
    """Returns once the check warm_vec_isa started has finished: Inductor's list is cached per process but not
    locked, so a second caller beside the thread would run every probe again."""
    for check in _VEC_ISA_CHECK:
        check.join()


def is_inductor_glue(source: str) -> bool:
    """Whether a graph's bound source runs Inductor's module (GLUE_LINE among its settings at the top)."""
    return source.startswith(GLUE_LINE) or f"\n{GLUE_LINE}" in source


def warm_vec_isa() -> None:
    """Start Inductor's check of the vector instruction sets its C++ may use on a daemon thread, once per process.
    With an empty Inductor cache the check builds a test library per set (~9 s of g++ on a 2-core machine; both
    this process's and the glue worker's compiles then find them on disk), and Inductor does it at the first
    compile that needs it: started with the first graph, it overlaps the tracing of the next ones. With the test
    libraries on disk it still loads each in a subprocess (~1.2 s on that machine), which a process whose graphs
    come from the compile cache pays when it loads the first one with Inductor's glue (tiny deepseek_v32's
    symbolic decode graph, the third): the backend starts the check at its first cache hit on an entry with
    Inductor's glue (a warm cache's prefill graph too), so that it overlaps Dynamo's tracing of the graphs after;
    a compile starts it where its lowering picks Inductor's glue. The list is what Inductor computes for itself
    (the user's own Inductor compiles use it too)."""
    if not _VEC_ISA_CHECK:
        _VEC_ISA_CHECK.append(threading.Thread(target=_check_vec_isa, name="ascend-dsa-vec-isa", daemon=True))
        _VEC_ISA_CHECK[0].start()


def symbolic_inputs(gm: torch.fx.GraphModule) -> bool:
    """Whether an input of gm has a symbolic value, size or stride: a graph Dynamo made, after a recompile, to serve
    every later size (a generate() loop's decode steps), as against one traced for the sizes of one call."""
    def symbolic(value: object) -> bool:
        if isinstance(value, torch.SymInt):
            return True
        return isinstance(value, Tensor) and any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride()))
    return any(symbolic(node.meta.get("val")) for node in gm.graph.find_nodes(op="placeholder"))


def _rms_norm(x: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    y, rstd = reference_rms_norm(x, gamma, epsilon)
    return y.contiguous(), rstd                 # the op's layout (its fake): the graph's later views rely on it


def _add_rms_norm(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    y, rstd, x = reference_add_rms_norm(x1, x2, gamma, epsilon)
    return y.contiguous(), rstd, x.contiguous()


def _decompositions() -> dict[object, object]:
    """Inductor's table plus the elementwise fused ops written out: at decode sizes Inductor's loop for an RMSNorm
    or a RoPE, fused with its neighbours, costs less than a call of the op's CPU implementation; the ops with a
    search, a gather or data checks (indexer, sparse attention, MoE, causal_lengths) stay single calls."""
    from torch._inductor.decomposition import select_decomp_table
    ops = torch.ops.ascend_dsa
    return {**select_decomp_table(), ops.rms_norm.default: _rms_norm, ops.add_rms_norm.default: _add_rms_norm,
            ops.rotary_mul.default: reference_rotary_mul}


def traced_inputs(gm: torch.fx.GraphModule) -> list[object]:
    """The graph's inputs as traced: fake tensors and SymInts from its placeholders' meta."""
    values = []
    for node in gm.graph.find_nodes(op="placeholder"):
        if "val" not in node.meta:
            raise ValueError(f"placeholder {node.name} has no traced value; Inductor cannot compile the graph")
        values.append(node.meta["val"])
    return values


def compile_forward(gm: torch.fx.GraphModule) -> str:
    """Inductor's module source for `gm` (an inference ATen graph without get_attr nodes), ending in a
    `forward(self, *inputs)` that returns the graph's outputs as a tuple."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from npu_graph.runtime import batched_kernels  # imports Inductor: only where a compile needs it

    if gm.graph.find_nodes(op="get_attr"):
        raise ValueError("the graph reads attributes; lift them into inputs before Inductor compiles it")
    vec_isa_checked()
    gm.graph.eliminate_dead_code()
    gm.recompile()
    sources: list[str] = []
    relayouts: list[tuple[int, ...]] = []
    traced = glue_layouts.traced_output_layouts(gm)

    def inner(graph: torch.fx.GraphModule, inputs: list[object], **kwargs: object) -> object:
        context = torch._guards.TracingContext.try_get()
        meta = None if context is None else context.fw_metadata
        _check_plain(meta)
        compiled = compile_fx_inner(graph, inputs, **kwargs)
        kinds = [info.output_type.name for info in meta.output_info]
        try:
            relayouts.append(glue_layouts.outputs_to_relayout(traced, getattr(compiled, "output_strides", None),
                                                              kinds))
        except glue_layouts.LayoutMismatch as exc:
            raise GlueUnsupported(str(exc)) from exc
        sources.append(getattr(compiled, "source_code", ""))
        return compiled

    # AOT autograd's own cache would hand back a compiled function without calling `inner` (no source to bind);
    # Inductor's FX graph cache below it still serves a graph compiled before.
    with torch._functorch.config.patch(enable_autograd_cache=False), batched_kernels.building_batched(), \
            torch._inductor.config.patch({"cpp.threads": 1, "size_asserts": False}):
        compile_fx(gm, traced_inputs(gm), inner_compile=inner, decompositions=_decompositions())
    source = sources[-1] if len(sources) == 1 else None
    if not source:
        raise RuntimeError("Inductor returned no module source for the graph")
    body = source.split("\nif __name__ == \"__main__\":", 1)[0]
    # Inductor's header names the process's AOT compile counter: the same graph compiled again (a cache hit's dump)
    # would differ in that comment alone
    return _with_batched_kernels(_AOT_ID.sub("", body)) + glue_layouts.adapter(relayouts[-1])


_ASYNC_COMPILE = "\nasync_compile = AsyncCompile()\n"


def _with_batched_kernels(source: str) -> str:
    """Inductor's module source with its kernels built together (npu_graph.runtime.batched_kernels): the module
    that compile_fx loaded ran with BatchedKernels, so its libraries are the ones this source loads. A source that
    does not create `async_compile = AsyncCompile()` once (another Inductor wrapper) is kept as it is: its kernels
    are then built one by one when it runs."""
    if source.count(_ASYNC_COMPILE) != 1:
        return source
    return source.replace(_ASYNC_COMPILE, "\nfrom npu_graph.runtime.batched_kernels import BatchedKernels\n"
                          "async_compile = BatchedKernels()\n")

"""summary.json's `implementations`: for every fused op of a CPU graph, which implementation it runs on this CPU
(the native kernel at the active instruction-set level, or the torch path) and why, as kernels/native/dispatch.py
decides it for the op's shape class at the graph's example sizes: measured already, measured at the first call, forced
by ASCEND_DSA_NATIVE, or a native kernel that does not take these inputs."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from npu_graph.kernels import attn_res
from npu_graph.kernels.indexer import causal_lengths, lightning_indexer
from npu_graph.kernels.kda import chunk_kda
from npu_graph.kernels.kda import native as chunk_kda_native
from npu_graph.kernels.moe import fused_moe
from npu_graph.kernels.moe import gating as moe_gating
from npu_graph.kernels.moe import gating_native as moe_gating_native
from npu_graph.kernels.native import cpu_isa, dispatch
from npu_graph.kernels.native import prebuild as native_prebuild
from npu_graph.kernels.rowwise import rms_norm, rotary_mul
from npu_graph.kernels.sparse_attention import sparse_flash_attention as sfa
from npu_graph.observe.report import graph_nodes
from npu_graph.targets.cpu_bindings import NATIVE_KERNELS

# fused op -> (its shape-class function, the native library it runs)
NATIVE_CLASSES: dict[str, tuple[Callable[..., tuple | None], str]] = {
    "lightning_indexer": (lightning_indexer.native_class, "lightning_indexer"),
    "sparse_flash_attention": (sfa.native_class, sfa.NATIVE_SOURCE),
    "chunk_kda": (chunk_kda.native_class, chunk_kda_native.NATIVE_SOURCE),
    "rms_norm": (rms_norm.native_class, rms_norm.NATIVE_SOURCE),
    "add_rms_norm": (rms_norm.add_native_class, rms_norm.NATIVE_SOURCE),
    "attn_res": (attn_res.native_class, attn_res.NATIVE_SOURCE),
    "rotary_mul": (rotary_mul.native_class, rotary_mul.NATIVE_SOURCE),
    "moe_gating_top_k": (moe_gating.native_class, moe_gating_native.NATIVE_SOURCE),
    "causal_lengths": (causal_lengths.native_class, causal_lengths.NATIVE_SOURCE),
    "fused_moe": (fused_moe.native_class, fused_moe.NATIVE_SOURCE),
}
# the name each op records its choices under in kernels/native/dispatch.py (where it differs from the op's)
_DISPATCH_NAME = {"add_rms_norm": "rms_norm"}


def _hint(size: Any) -> int | None:
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return None if hint is None else int(hint)
    return int(size)


def _concrete(value: Any, mode: FakeTensorMode) -> Any:
    """A fake tensor with the example (hinted) sizes and strides of `value`, so that shape classes read plain
    ints and add no guard to the graph's shape environment; None where a size has no hint."""
    if not isinstance(value, torch.Tensor):
        return value
    sizes, strides = [_hint(s) for s in value.shape], [_hint(s) for s in value.stride()]
    if None in sizes or None in strides:
        raise LookupError("symbolic size without an example value")
    with mode:
        return torch.empty_strided(sizes, strides, dtype=value.dtype, device=value.device)


def _arguments(node: torch.fx.Node, mode: FakeTensorMode) -> tuple[list[Any], dict[str, Any]]:
    def value(a: Any) -> Any:
        return _concrete(a.meta.get("val"), mode) if isinstance(a, torch.fx.Node) else a
    return [value(a) for a in node.args], {k: value(v) for k, v in node.kwargs.items()}


def _describe(op: str, node: torch.fx.Node, mode: FakeTensorMode) -> dict[str, Any]:
    level = cpu_isa.active()
    if op not in NATIVE_CLASSES:
        return {"impl": "torch", "level": level, "why": "no native kernel for this op"}
    classify, library = NATIVE_CLASSES[op]
    try:
        args, kwargs = _arguments(node, mode)
    except LookupError as e:
        return {"impl": "measured at first call", "level": level, "why": str(e)}
    cls = classify(*args, **kwargs)
    if cls is None:
        return {"impl": "torch", "level": level, "why": "the native kernel is not loaded or does not take these inputs"}
    return {"shape_class": list(cls), "library": library,
            **dispatch.describe(_DISPATCH_NAME.get(op, op), library, cls)}


def refresh(entries: list[dict[str, Any]]) -> bool:
    """Fills in the choices measured since the entries were made (at the graph's first call); whether any
    changed."""
    changed = False
    for entry in entries:
        if entry["impl"] == "measured at first call" and "shape_class" in entry:
            now = dispatch.describe(_DISPATCH_NAME.get(entry["op"], entry["op"]), entry["library"],
                                    tuple(entry["shape_class"]))
            changed |= now["impl"] != entry["impl"]
            entry.update(now)
    return changed


def refreshed_after_first_call(compiled: Callable[..., Any], entries: list[dict[str, Any]],
                               write: Callable[[], None]) -> Callable[..., Any]:
    """`compiled`, which after its first call fills in the choices that call measured and rewrites the summary
    (`write`), so a dump says what ran; later calls go straight through."""
    if not any(entry["impl"] == "measured at first call" for entry in entries):
        return compiled
    pending = [True]

    def call(*args: Any) -> Any:
        out = compiled(*args)
        if pending:
            pending.clear()
            if refresh(entries):
                write()
        return out
    return call


def implementations(gm: torch.fx.GraphModule) -> list[dict[str, Any]]:
    """One entry per fused-op node: {node, op, impl, level, why, ...} (module docstring). The native libraries the
    lowering will load (the fused ops' and NATIVE_KERNELS' for the ATen calls) are built first, side by side."""
    mode = FakeTensorMode()
    calls = [node for node in graph_nodes(gm)
             if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)]
    fused = [(node, node.target._opname) for node in calls if node.target.namespace == "ascend_dsa"]
    aten = [f"{node.target._opname}.{node.target._overloadname}" for node in calls if node.target.namespace == "aten"]
    native_prebuild.build_now([NATIVE_CLASSES[op][1] for _, op in fused if op in NATIVE_CLASSES]
                              + [NATIVE_KERNELS[name] for name in aten if name in NATIVE_KERNELS])
    return [{"node": node.name, "op": op, **_describe(op, node, mode)} for node, op in fused]

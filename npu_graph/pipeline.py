"""The pass pipeline: one literal, ordered list of graph passes, and the loop that runs it.

A pass is a module in npu_graph.passes with `NAME`, `INFERENCE_ONLY` and `run(gm, ctx) -> PassResult`.
Its `uuid` is the hash of its source, so editing a pass changes every cache key that depends on it.
canonical_form writes what varies between authors in one form before any fusion pass (passes/canonical/).
canonicalize runs twice: first on the captured graph, then on what the rewrites left (view chains and no-op
reshapes that the fusion passes' operand layouts create) before streams and SuperKernels are planned.
eliminate_common_subexpressions runs only after the rewrites: merging repeated nodes earlier would give the
patterns' intermediate nodes extra users and hide matches. reinplace_functionalized runs after assign_streams:
it compares node positions, which scheduling changes.
"""
from __future__ import annotations

import hashlib
import inspect
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch.fx

from npu_graph.pass_api import MetaKey, PassContext, PassResult
from npu_graph.passes import (
    absorb_mla,
    assign_streams,
    canonical_form,
    canonicalize,
    causal_sdpa,
    conv_channels_last,
    eliminate_common_subexpressions,
    fuse_add_rms_norm,
    fuse_attention,
    fuse_attn_res,
    fuse_kda_step,
    fuse_lightning_indexer,
    fuse_moe_experts,
    fuse_moe_gating,
    fuse_rms_norm,
    fuse_rope,
    fuse_sibling_matmuls,
    fuse_sparse_attention,
    layout_nz,
    partition_superkernels,
    quantize,
    reinplace_functionalized,
    reinplace_input_writes,
    short_depthwise_conv,
    vllm_ops,
)

PASSES: list[ModuleType] = [
    vllm_ops,
    canonical_form,
    canonicalize,
    short_depthwise_conv,
    conv_channels_last,
    fuse_lightning_indexer,
    absorb_mla,
    fuse_sparse_attention,
    fuse_rms_norm,
    fuse_add_rms_norm,
    fuse_attn_res,
    fuse_attention,
    causal_sdpa,
    fuse_moe_experts,
    fuse_moe_gating,
    fuse_kda_step,
    fuse_rope,
    quantize,
    layout_nz,
    reinplace_input_writes,
    eliminate_common_subexpressions,
    fuse_sibling_matmuls,
    canonicalize,
    assign_streams,
    reinplace_functionalized,
    partition_superkernels,
]


@dataclass
class PassRecord:
    name: str
    uuid: str
    ms: float
    changed: bool
    skipped: str | None
    nodes: int
    stats: dict[str, Any]
    summary: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "uuid": self.uuid, "ms": round(self.ms, 3), "changed": self.changed,
                "skipped": self.skipped, "nodes": self.nodes, "stats": self.stats}


class PassError(RuntimeError):
    """A pass raised; carries the pass name so the fallback warning can say which step failed."""

    def __init__(self, pass_name: str, cause: BaseException):
        super().__init__(f"pass {pass_name!r} failed: {type(cause).__name__}: {cause}")
        self.pass_name = pass_name


def pass_names() -> list[str]:
    return [p.NAME for p in PASSES]


def pass_uuid(p: ModuleType) -> str:
    return hashlib.sha256(inspect.getsource(p).encode()).hexdigest()[:16]


def pipeline_uuids() -> dict[str, str]:
    """uuid of every pass, in pipeline order (part of the cache key)."""
    return {p.NAME: pass_uuid(p) for p in PASSES}


def _skip_reason(p: ModuleType, ctx: PassContext) -> str | None:
    if p.NAME in ctx.config.passes.disabled:
        return "disabled"
    if p.INFERENCE_ONLY and not ctx.inference:
        return "graph needs autograd"
    return None


def _run_one(p: ModuleType, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Run one pass; nodes it creates are tagged with its name (meta["created_by"])."""
    existing = set(gm.graph.nodes)
    try:
        result = p.run(gm, ctx)
    except Exception as exc:
        raise PassError(p.NAME, exc) from exc
    if result.changed:
        for node in gm.graph.nodes:
            if node not in existing:
                node.meta[MetaKey.CREATED_BY] = p.NAME
        gm.graph.lint()
        gm.recompile()
    return result


def run_pipeline(gm: torch.fx.GraphModule, ctx: PassContext) -> list[PassRecord]:
    """Run every pass in order; dump the graph after each one that ran."""
    records = []
    for p in PASSES:
        reason = _skip_reason(p, ctx)
        start = time.perf_counter()
        result = PassResult(changed=False)
        if reason is None:
            result = _run_one(p, gm, ctx)
        ms = (time.perf_counter() - start) * 1e3
        record = PassRecord(p.NAME, pass_uuid(p), ms, result.changed, reason, len(gm.graph.nodes),
                            result.stats, result.summary)
        records.append(record)
        if ctx.dump is not None and reason is None:
            ctx.dump.write_stage(len(records), p.NAME, gm, record.to_json(), result.changed)
    return records

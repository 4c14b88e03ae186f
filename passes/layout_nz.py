"""layout_nz: plan the layout of every weight that feeds a matmul, and realise the plan where the target asks.

A weight is a model parameter (PassContext.param_indices) read, through views only, by a matmul (mm, addmm,
bmm, baddbmm, linear, fused_moe). Its plan goes into node.meta["layout"] of the placeholder:
{"format": "FRACTAL_NZ" | "ND", "fractal": [16, 16] (16-bit and 32-bit) | [16, 32] (8-bit) | None, "reason"}.
The NPU target casts NZ weights once at load (`torch_npu.npu_format_cast(w, 29)`). A target whose description
names a weight form (PassContext.machine.weight_form; the CPU's is the form its GEMM is measured fastest with,
npu_graph.targets.cpu_gemm_profile) has it realised in the graph: PRE_TRANSPOSED turns `mm(x, t(w))` into
`mm(x, clone(t(w)))`, a contiguous pre-transposed weight that the parameter prologue computes once per
parameter version, never per call. Numbers are unchanged. `layout.nz="off"` plans ND everywhere and leaves
the CPU weights as they are.
"""
from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import torch
import torch.fx

from npu_graph.kernels.nz import nz_fractal
from npu_graph.pass_api import PRE_TRANSPOSED, MetaKey, PassContext, PassResult
from npu_graph.passes.matching.values import RESHAPES, UNIT_DIMS, val

NAME = "layout_nz"
INFERENCE_ONLY = True
MIN_DIM = 16

aten = torch.ops.aten
MATMULS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1),
           aten.baddbmm.default: (1, 2), aten.linear.default: (1,),
           torch.ops.ascend_dsa.fused_moe.default: (1, 2)}
VIEWS = RESHAPES | UNIT_DIMS | {aten.t.default, aten.permute.default, aten.transpose.int, aten.expand.default,
                               aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default,
                               aten.alias.default}


def _source_weight(node: object, params: set[torch.fx.Node]) -> torch.fx.Node | None:
    """The parameter placeholder that `node` reads through views only, if any."""
    while isinstance(node, torch.fx.Node):
        if node in params:
            return node
        if node.op != "call_function" or (node.target not in VIEWS and node.target is not operator.getitem):
            return None
        node = node.args[0]
    return None


def plan(weight: torch.Tensor, nz: str) -> dict[str, Any]:
    """The layout record of one matmul weight."""
    if nz == "off":
        return {"format": "ND", "fractal": None, "reason": "layout.nz='off'"}
    if weight.dim() < 2 or min(weight.shape[-2:]) < MIN_DIM:
        return {"format": "ND", "fractal": None,
                "reason": f"a matrix dim below {MIN_DIM}: an NZ fractal would be mostly padding"}
    if weight.element_size() not in (1, 2, 4):
        return {"format": "ND", "fractal": None, "reason": f"{weight.dtype} has no NZ fractal"}
    rows, cols = nz_fractal(weight.dtype)
    bits = weight.element_size() * 8
    return {"format": "FRACTAL_NZ", "fractal": [rows, cols],
            "reason": f"frozen matmul weight, {bits}-bit: {rows}x{cols} fractals"}


def _weights(gm: torch.fx.GraphModule, params: set[torch.fx.Node]) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """{weight placeholder: the matmuls that read it}."""
    found: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        for index in MATMULS.get(node.target, ()):
            weight = _source_weight(node.args[index], params) if index < len(node.args) else None
            if weight is not None:
                found.setdefault(weight, []).append(node)
    return found


def _realise_pre_transposed(gm: torch.fx.GraphModule, weight: torch.fx.Node, users: list[torch.fx.Node]) -> int:
    """mm/addmm reading t(weight) read a contiguous pre-transposed copy instead; returns how many changed."""
    changed = 0
    for t in [u for u in weight.users if u.target in (aten.t.default, aten.permute.default)]:
        if t.target is aten.permute.default and list(t.args[1]) != [1, 0]:
            continue
        readers = [u for u in t.users if u in users and u.target in (aten.mm.default, aten.addmm.default)]
        if not readers:
            continue
        with gm.graph.inserting_after(t):
            packed = gm.graph.call_function(aten.clone.default, (t,), {"memory_format": torch.contiguous_format})
        packed.meta["val"] = val(t).clone(memory_format=torch.contiguous_format)
        for reader in readers:
            reader.replace_input_with(t, packed)
            changed += 1
    return changed


def _form(ctx: PassContext, weight: torch.fx.Node) -> str | None:
    """The form the target gives this weight in the graph, if it realises layouts itself and nz is not off."""
    if ctx.machine.weight_form is None or ctx.config.layout.nz == "off":
        return None
    return ctx.machine.weight_form(val(weight).dtype, tuple(val(weight).shape))


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    params = ctx.param_placeholders(gm)
    weights = _weights(gm, params)
    records, realised = [], 0
    for weight, users in weights.items():
        layout = plan(val(weight), ctx.config.layout.nz)
        weight.meta[MetaKey.LAYOUT] = layout
        cpu_form = _form(ctx, weight)
        if cpu_form == PRE_TRANSPOSED and _realise_pre_transposed(gm, weight, users):
            realised += 1
        else:
            cpu_form = None
        records.append({"weight": weight.name, "shape": list(val(weight).shape), "dtype": str(val(weight).dtype),
                        **layout, "consumers": sorted({str(u.target) for u in users}), "cpu_form": cpu_form})
    counts = Counter(r["format"] for r in records)
    summary = {"layouts": {"weights": records, "counts": dict(counts), "cpu_realised": realised}}
    return PassResult(changed=realised > 0, stats={"weights": len(records), **counts, "cpu_realised": realised},
                      summary=summary)

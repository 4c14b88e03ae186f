"""vllm_ops: vLLM's custom CPU ops for RMSNorm, residual add + RMSNorm and SiLU-and-mul -> the math they compute.

vLLM writes these layers as calls of its own ops (`_C::rms_norm`, `_C::fused_add_rms_norm`, `_C::silu_and_mul`,
each writing its result into an argument) when a compilation config enables them (`custom_ops: ["+rms_norm",
"+silu_and_mul"]`, vLLM's default on GPUs). To every other pass such a call is opaque. This pass, the first,
replaces each with the ATen ops of its definition, written the way vLLM's CPU kernels compute it:
    rms_norm(out, x, w, eps):            out = (x·rsqrt(mean(x², -1) + eps) in fp32)·w, in x's dtype
    fused_add_rms_norm(x, res, w, eps):  res = x + res;  x = rms_norm(res, w, eps)
    silu_and_mul(out, x):                out = silu(x[..., :d])·x[..., d:],  d = x.shape[-1] / 2
so the canonical form and the fusions see them like any other spelling: fuse_rms_norm and fuse_add_rms_norm
turn them into `ascend_dsa.rms_norm` / `add_rms_norm` (and the NPU target into torch_npu's), and what no pass
fuses runs as the ATen ops, with the same numbers. In the graph a call is AOT's `auto_functionalized_v2`; the
written arguments' new values (its result items) become the new nodes. A call is left as it is when an op of
that name has another schema, or when it writes a view of a tensor rather than a whole one. vLLM's rotary
(`_C::rotary_embedding`) and linear ops pass through untouched.
"""
from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx

from npu_graph.pass_api import PassContext, PassResult
from npu_graph.passes.matching.meta_refresh import meta_snapshot, refresh_meta

NAME = "vllm_ops"
INFERENCE_ONLY = True

aten = torch.ops.aten
FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized_v2
Node = torch.fx.Node
# Schema of each op this pass knows (vLLM 0.x): argument count and which arguments it writes, by position.
KNOWN = {"_C::rms_norm": ("rms_norm", 4, (0,)), "_C::fused_add_rms_norm": ("fused_add_rms_norm", 4, (0, 1)),
         "_C::silu_and_mul": ("silu_and_mul", 2, (0,))}
_VIEW_KEYS = ("size", "stride", "storage_offset", "slice_dim", "slice_start", "slice_end", "alias")


class _Call:
    """One auto_functionalized_v2 call: its op's arguments by position, and each written one's new-value items."""

    def __init__(self, node: Node, schema: torch.FunctionSchema):
        self.node, self.graph = node, node.graph
        self.names = [a.name for a in schema.arguments]
        self.results = max(1, len(schema.returns))

    def written_whole(self, position: int) -> bool:
        name = self.names[position]
        return f"_{name}_base_index" in self.node.kwargs and not any(
            f"_{name}_{key}" in self.node.kwargs for key in _VIEW_KEYS)

    def arg(self, position: int) -> object:
        name = self.names[position]
        if f"_{name}_base_index" in self.node.kwargs:
            return self.node.kwargs["_all_bases"][self.node.kwargs[f"_{name}_base_index"]]
        return self.node.kwargs.get(name)

    def replace_written(self, position: int, value: Node) -> None:
        """The call's item for the new value of written argument `position` is `value` from now on."""
        item = self.results + self.node.kwargs[f"_{self.names[position]}_base_index"]
        for user in list(self.node.users):
            if user.target is operator.getitem and user.args[1] == item:
                value.meta["val"] = user.meta["val"]    # later calls in this run read it; refresh_meta redoes all
                user.replace_all_uses_with(value)
                self.graph.erase_node(user)

    def op(self, target: object, *args: object) -> Node:
        return self.graph.call_function(target, args)


def _rms_norm(call: _Call, x: Node, weight: object, eps: float, dtype: torch.dtype) -> Node:
    wide = x if dtype == torch.float32 else call.graph.call_function(aten._to_copy.default, (x,),
                                                                     {"dtype": torch.float32})
    variance = call.graph.call_function(aten.mean.dim, (call.op(aten.mul.Tensor, wide, wide), [-1], True))
    normed = call.op(aten.mul.Tensor, wide, call.op(aten.rsqrt.default, call.op(aten.add.Scalar, variance, eps)))
    if isinstance(weight, Node):
        normed = call.op(aten.mul.Tensor, normed, weight)
    if dtype == torch.float32:
        return normed
    return call.graph.call_function(aten._to_copy.default, (normed,), {"dtype": dtype})


def _expand_rms_norm(call: _Call) -> None:
    x = call.arg(1)
    call.replace_written(0, _rms_norm(call, x, call.arg(2), call.arg(3), x.meta["val"].dtype))


def _expand_fused_add_rms_norm(call: _Call) -> None:
    total = call.op(aten.add.Tensor, call.arg(0), call.arg(1))
    normed = _rms_norm(call, total, call.arg(2), call.arg(3), call.arg(0).meta["val"].dtype)
    call.replace_written(0, normed)
    call.replace_written(1, total)


def _expand_silu_and_mul(call: _Call) -> None:
    x = call.arg(1)
    width: object = x.meta["val"].shape[-1]
    if not isinstance(width, int):              # read at run time
        width = call.op(aten.sym_size.int, x, x.meta["val"].dim() - 1)
    half = width // 2 if isinstance(width, int) else call.op(operator.floordiv, width, 2)
    gate = call.op(aten.slice.Tensor, x, -1, 0, half)
    up = call.op(aten.slice.Tensor, x, -1, half, width)
    call.replace_written(0, call.op(aten.mul.Tensor, call.op(aten.silu.default, gate), up))


EXPANSIONS: dict[str, Callable[[_Call], None]] = {
    "rms_norm": _expand_rms_norm, "fused_add_rms_norm": _expand_fused_add_rms_norm,
    "silu_and_mul": _expand_silu_and_mul}


def known_call(node: Node, known: dict[str, tuple[str, int, tuple[int, ...]]]) -> tuple[str, _Call] | None:
    """(expansion name, call) for an auto_functionalized_v2 call of a known op with its known schema."""
    if node.op != "call_function" or node.target is not FUNCTIONALIZED or not node.args:
        return None
    schema = getattr(node.args[0], "_schema", None)
    entry = known.get(schema.name) if schema is not None else None
    if entry is None:
        return None
    kind, arity, written = entry
    writes = tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
    call = _Call(node, schema)
    if len(schema.arguments) != arity or writes != written or not all(call.written_whole(i) for i in written):
        return None
    return kind, call


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    before = meta_snapshot(gm)
    expanded: dict[str, int] = {}
    for node in list(gm.graph.nodes):
        found = known_call(node, KNOWN)
        if found is None:
            continue
        kind, call = found
        with gm.graph.inserting_before(node):
            EXPANSIONS[kind](call)
        if not node.users:
            gm.graph.erase_node(node)
        expanded[kind] = expanded.get(kind, 0) + 1
    if not expanded:
        return PassResult(False)
    gm.graph.lint()
    refresh_meta(gm, since=before)
    return PassResult(True, {"expanded": expanded})

"""Binding a CPU graph's calls, a lowering step: the generated source's `torch.ops.ascend_dsa.<op>.default(`
and `torch.ops.aten.<op>.<overload>(` calls become calls of plain names, each bound once by a header of
assignments at the top of the source (`_rms = _bind.fused("rms_norm")`, `_aten_mul_Tensor = _bind.aten("mul",
"Tensor")`, `_native_skinny_mm = _bind.native("skinny_mm", "mm", "default")`); in Inductor's generated module
(runtime.inductor_glue) also its `extern_kernels.mm(a, b, out=buf)` products, each call site bound on its own
(`_extern_mm_0 = _bind.extern("mm")`: a site keeps the plan of its last call, kernels/aten/skinny_mm.py), and
calls of ops that write their arguments (`torch.ops.higher_order.auto_functionalized_v2(`, bound as
`_functionalized = _bind.functionalized()`: npu_graph.runtime.functionalized).

The result is the source that is cached, dumped as compiled.py and run: nothing rewrites it when it is loaded.
`_bind` is the runtime's binder (npu_graph.runtime.direct_calls): fused ops' Python implementations, ATen callables,
native kernels where their library is loaded (ASCEND_DSA_NATIVE=0 is read then) — or, for a trace of the source
(an Inductor SuperKernel region), the torch.ops overloads themselves.
"""
from __future__ import annotations

import re

FUSED_PREFIX = "_ascend_dsa_direct_"
ATEN_PREFIX = "_aten_"
NATIVE_PREFIX = "_native_"
EXTERN_PREFIX = "_extern_"
FUNCTIONALIZED = "_functionalized"
HEADER = "# calls bound when the graph is loaded (npu_graph.targets.cpu_bindings)\n"

_FUSED_CALL = re.compile(r"torch\.ops\.ascend_dsa\.(\w+)\.default\(")
_ATEN_CALL = re.compile(r"torch\.ops\.aten\.(\w+)\.(\w+)\(")
# Inductor's products it does not generate code for: torch.mm / bmm / addmm with out=, which fork BLAS's thread
# team for decode-sized work unless bound (runtime.direct_calls)
_EXTERN_CALL = re.compile(r"\bextern_kernels\.(mm|bmm|addmm)\(")
_FUNCTIONALIZED_CALL = re.compile(r"\btorch\.ops\.higher_order\.auto_functionalized_v2\(")

# ATen overloads a native kernel takes where it applies (its module in npu_graph.kernels; the overload otherwise)
NATIVE_KERNELS = {"mm.default": "skinny_mm", "bmm.default": "skinny_bmm", "convolution.default": "depthwise_conv1d",
                  "_scaled_dot_product_flash_attention_for_cpu.default": "dense_attention"}


def bind_source(source: str) -> str:
    """`source` with its fused-op and ATen calls calling names that a header binds once (module docstring)."""
    bindings: dict[str, str] = {}

    def fused(match: re.Match) -> str:
        name = FUSED_PREFIX + match.group(1)
        bindings[name] = f"_bind.fused({match.group(1)!r})"
        return name + "("

    def aten(match: re.Match) -> str:
        op, overload = match.groups()
        kernel = NATIVE_KERNELS.get(f"{op}.{overload}")
        if kernel:
            name, expr = NATIVE_PREFIX + kernel, f"_bind.native({kernel!r}, {op!r}, {overload!r})"
        else:
            name, expr = f"{ATEN_PREFIX}{op}_{overload}", f"_bind.aten({op!r}, {overload!r})"
        bindings[name] = expr
        return name + "("

    def extern(match: re.Match) -> str:
        name = f"{EXTERN_PREFIX}{match.group(1)}_{len(bindings)}"
        bindings[name] = f"_bind.extern({match.group(1)!r})"
        return name + "("

    def functionalized(match: re.Match) -> str:
        bindings[FUNCTIONALIZED] = "_bind.functionalized()"
        return FUNCTIONALIZED + "("

    body = _EXTERN_CALL.sub(extern, _ATEN_CALL.sub(aten, _FUSED_CALL.sub(fused, source)))
    body = _FUNCTIONALIZED_CALL.sub(functionalized, body)
    if not bindings:
        return source
    return HEADER + "".join(f"{name} = {expr}\n" for name, expr in sorted(bindings.items())) + body

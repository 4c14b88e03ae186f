"""Benchmark cases for the quantization, NZ and RMSNorm kernels, for `ascend-dsa bench kernels`.

Every case runs on one [4096, 7168] activation (a DeepSeek-V3 hidden state of 4096 tokens) and times three
candidates side by side: a plain copy of the same tensor (`x.clone()`, the memory-bound floor and the
baseline), the unfused eager torch code the op replaces (its `reference_*`; NZ packing has none), and
the ascend_dsa op.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from npu_graph.kernels import nz
from npu_graph.kernels.quant import block as block_quant
from npu_graph.kernels.quant import mx as mx_quant
from npu_graph.kernels.rowwise import rms_norm

ROWS, HIDDEN = 4096, 7168
OPS = torch.ops.ascend_dsa


def _case(name: str, copy_of: torch.Tensor, reference: Callable[[], object] | None,
          ours: Callable[[], object]) -> dict[str, Any]:
    candidates = {"copy": copy_of.clone, "eager reference": reference, "ascend_dsa": ours}
    return {"name": name, "candidates": {label: fn for label, fn in candidates.items() if fn is not None},
            "baseline": "copy", "ours": "ascend_dsa", "elements": copy_of.numel()}


def _quant_cases(x32: torch.Tensor, x16: torch.Tensor) -> list[dict[str, Any]]:
    y_mx, s_mx = OPS.dynamic_mx_quant(x32)
    y_blk, s_blk = OPS.dynamic_block_quant(x32)
    return [
        _case("dynamic_mx_quant fp32->e4m3", x32, lambda: mx_quant.reference_dynamic_mx_quant(x32),
              lambda: OPS.dynamic_mx_quant(x32)),
        _case("dynamic_mx_quant bf16->e4m3", x16, lambda: mx_quant.reference_dynamic_mx_quant(x16),
              lambda: OPS.dynamic_mx_quant(x16)),
        _case("dequant_mx e4m3->fp32", x32, lambda: mx_quant.reference_dequant_mx(y_mx, s_mx),
              lambda: OPS.dequant_mx(y_mx, s_mx)),
        _case("dynamic_block_quant fp32 (fp32 scale)", x32,
              lambda: block_quant.reference_dynamic_block_quant(x32), lambda: OPS.dynamic_block_quant(x32)),
        _case("dynamic_block_quant bf16 (ue8m0 scale)", x16,
              lambda: block_quant.reference_dynamic_block_quant(x16, scale_fmt="ue8m0"),
              lambda: OPS.dynamic_block_quant(x16, scale_fmt="ue8m0")),
        _case("dequant_block e4m3->fp32", x32, lambda: block_quant.reference_dequant_block(y_blk, s_blk),
              lambda: OPS.dequant_block(y_blk, s_blk)),
    ]


def _norm_cases(x32: torch.Tensor, x16: torch.Tensor, residual: torch.Tensor) -> list[dict[str, Any]]:
    gamma16 = torch.rand(HIDDEN, dtype=torch.bfloat16) + 0.5
    gamma32 = gamma16.float()
    return [
        _case("rms_norm bf16", x16, lambda: rms_norm.reference_rms_norm(x16, gamma16),
              lambda: OPS.rms_norm(x16, gamma16)),
        _case("rms_norm fp32", x32, lambda: rms_norm.reference_rms_norm(x32, gamma32),
              lambda: OPS.rms_norm(x32, gamma32)),
        _case("add_rms_norm bf16", x16, lambda: rms_norm.reference_add_rms_norm(x16, residual, gamma16),
              lambda: OPS.add_rms_norm(x16, residual, gamma16)),
    ]


def _nz_cases(x16: torch.Tensor) -> list[dict[str, Any]]:
    packed = nz.pack_nz(x16)
    return [_case("pack_nz bf16", x16, None, lambda: nz.pack_nz(x16)),
            _case("unpack_nz bf16", x16, None, lambda: nz.unpack_nz(packed, x16.shape))]


def cases() -> list[dict[str, Any]]:
    """The benchmark cases of this file: {name, candidates, baseline, ours, elements} each."""
    g = torch.Generator().manual_seed(0)
    x32 = torch.randn(ROWS, HIDDEN, generator=g)
    x16 = x32.bfloat16()
    residual = torch.randn(ROWS, HIDDEN, generator=g).bfloat16()
    return _quant_cases(x32, x16) + _norm_cases(x32, x16, residual) + _nz_cases(x16)

"""`ascend_dsa::grouped_swiglu` — the local experts of an EP rank on the rows dispatch grouped for them.

    grouped_swiglu(x [A,H], w13 [L,2I,H], w2 [L,H,I], group_list [L] int) -> out [A,H] (x's dtype)

The first group_list[0] rows of x belong to local expert 0, the next group_list[1] to expert 1, and so on;
rows past sum(group_list) are padding (dispatch's static row bound) and come out as zeros. For a row of
expert e: out = w2[e] @ (silu(w13[e,:I] @ x) * (w13[e,I:] @ x)). It stands for torch_npu's
`npu_grouped_matmul(x, w13ᵀ, group_list)` -> `npu_swiglu` -> `npu_grouped_matmul(., w2ᵀ, group_list)`, the
expert step between `npu_moe_distribute_dispatch` and `npu_moe_distribute_combine`. Only the valid rows are
computed: the padding costs nothing but the zero fill.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from npu_graph.kernels.aten import skinny_mm
from npu_graph.kernels.checks import require, require_dtype, require_rank, require_same

OP = "grouped_swiglu"
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _validate(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, group_list: torch.Tensor) -> None:
    for name, t, rank in (("x", x, 2), ("w13", w13, 3), ("w2", w2, 3), ("group_list", group_list, 1)):
        require_rank(OP, name, t, rank)
    require_dtype(OP, "x", x, _FLOATS)
    require_same(OP, "dtypes of `w13` and `x`", w13.dtype, x.dtype)
    require_same(OP, "dtypes of `w2` and `x`", w2.dtype, x.dtype)
    require_dtype(OP, "group_list", group_list, (torch.int32, torch.int64))
    experts, inter2, hidden = w13.shape
    require_same(OP, "hidden size H of `x` [A,H] and `w13` [L,2I,H]", x.shape[1], hidden)
    require(inter2 % 2 == 0, f"{OP}: `w13` must stack gate and up rows, [L,2I,H]; got odd 2I={inter2}")
    require_same(OP, "shape of `w2` and [L,H,I] from `w13`", tuple(w2.shape), (experts, hidden, inter2 // 2))
    require_same(OP, "size of `group_list` and the expert count L of `w13`", group_list.shape[0], experts)


@torch.library.custom_op("ascend_dsa::grouped_swiglu", mutates_args=())
def grouped_swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each expert on its contiguous group of rows; see the module docstring."""
    _validate(x, w13, w2, group_list)
    counts = group_list.tolist()
    require(min(counts, default=0) >= 0 and sum(counts) <= x.shape[0],
            f"{OP}: `group_list` {counts} must be non-negative counts summing to at most the {x.shape[0]} rows "
            f"of `x`")
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n:
            gate, up = skinny_mm.linear(x[start:start + n], w13[e]).chunk(2, dim=-1)
            out[start:start + n] = skinny_mm.linear(F.silu(gate) * up, w2[e])
            start += n
    return out


@grouped_swiglu.register_fake
def _grouped_swiglu_fake(x, w13, w2, group_list):
    _validate(x, w13, w2, group_list)
    return torch.empty_like(x)

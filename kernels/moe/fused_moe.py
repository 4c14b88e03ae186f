"""`ascend_dsa::fused_moe` — routed SwiGLU experts: dispatch, grouped expert GEMMs, weighted combine.

    fused_moe(x [T,H], w13 [E,2I,H], w2 [E,H,I], topk_weights [T,k], topk_ids [T,k] int) -> out [T,H]

w13 holds each expert's gate rows first, then its up rows. With e = topk_ids[t,j]:

    out[t] = sum_j topk_weights[t,j] * w2[e] @ (silu(w13[e,:I] @ x[t]) * (w13[e,I:] @ x[t]))

out has x's dtype.

Non-finite values reach, by IEEE arithmetic, the outputs of the tokens that use them and nothing else, on every
path: a NaN or ±inf in x[t] or topk_weights[t] reaches token t's output, one in an expert's w13 or w2 the tokens
routed to that expert (an expert no token chose is never read). silu(-inf) is NaN (-inf / inf, as F.silu gives
it) and a routing weight 0 times an infinite expert output is NaN. Where a product or sum comes within rounding
of overflow, whether it overflows depends on the order of additions and, for bf16/fp16, on the dtype the
products round in, which differ between the paths.

The CPU implementation sorts the T*k (token, slot) pairs by expert once, gathers the
tokens of each active expert into one contiguous group, runs the two GEMMs per active expert on its
whole group (a grouped matmul; experts no token chose cost nothing), scales the rows by their routing
weight and scatters them back with one index_add_ into an fp32 accumulator. A single token (decode) skips
the dispatch and runs its k experts in turn. The native kernel (kernels/moe/fused_moe_native.py) does a call's tokens
one by one in one call (a decode token; a short prompt of a small model, where the grouped path's ~10 calls per
expert cost more than the arithmetic), where kernels/native/dispatch.py measured that faster for the shape class.
The GEMMs run in the input dtype: measured single-threaded on an AVX512-BF16 CPU (oneDNN), a bf16 expert
GEMM is about 3x faster than the fp32 one from 4 rows up and on par for a single row, and converting the
expert weights to fp32 would cost more than the GEMM itself.
"""
import functools

import torch
import torch.nn.functional as F

from npu_graph.kernels.aten import skinny_mm
from npu_graph.kernels.checks import (
    once_per_signature,
    require,
    require_dtype,
    require_rank,
    require_same,
    static_checks_needed,
    tensors_given,
)
from npu_graph.kernels.moe import fused_moe_native
from npu_graph.kernels.native import call_plans, dispatch

OP = "fused_moe"
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INDEX = (torch.int32, torch.int64)


@once_per_signature
def _validate(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> None:
    for name, t, rank in (("x", x, 2), ("w13", w13, 3), ("w2", w2, 3), ("topk_weights", topk_weights, 2),
                          ("topk_ids", topk_ids, 2)):
        require_rank(OP, name, t, rank)
    require_dtype(OP, "x", x, _FLOATS)
    require_same(OP, "dtypes of `w13` and `x`", w13.dtype, x.dtype)
    require_same(OP, "dtypes of `w2` and `x`", w2.dtype, x.dtype)
    require_dtype(OP, "topk_weights", topk_weights, _FLOATS)
    require_dtype(OP, "topk_ids", topk_ids, _INDEX)
    experts, inter2, hidden = w13.shape
    require_same(OP, "hidden size H of `x` [T,H] and `w13` [E,2I,H]", x.shape[1], hidden)
    require(inter2 % 2 == 0, f"{OP}: `w13` must stack gate and up rows, [E,2I,H]; got odd 2I={inter2}")
    require_same(OP, "shape of `w2` and [E,H,I] from `w13`", tuple(w2.shape), (experts, hidden, inter2 // 2))
    require_same(OP, "shape of `topk_weights` and `topk_ids`", tuple(topk_weights.shape), tuple(topk_ids.shape))
    require_same(OP, "token count T of `topk_ids` [T,k] and `x` [T,H]", topk_ids.shape[0], x.shape[0])


def _check_ids(topk_ids: torch.Tensor, experts: int) -> None:
    if topk_ids.numel():
        _require_ids(int(topk_ids.min()), int(topk_ids.max()), experts)


def _require_ids(low: int, high: int, experts: int) -> None:
    require(low >= 0 and high < experts, f"{OP}: `topk_ids` must lie in [0, {experts}); got values in [{low}, {high}]")


def _swiglu_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """w2 @ (silu(gate) * up) for the rows of x [n,H] with one expert's weights."""
    gate, up = skinny_mm.linear(x, w13).chunk(2, dim=-1)
    return skinny_mm.linear(F.silu(gate) * up, w2)


def reference_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """Loop over experts and the (token, slot) pairs routed to each, in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    xf, weights = x.float(), topk_weights.float()
    for e in range(w13.shape[0]):
        tokens, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        for t, j in zip(tokens.tolist(), slots.tolist()):
            y = _swiglu_expert(xf[t:t + 1], w13[e].float(), w2[e].float())
            out[t] += weights[t, j] * y[0]
    return out.to(x.dtype)


def _dispatch(topk_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, list[int]]:
    """Flat (token*k + slot) positions sorted by expert, and the group size of every expert."""
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    return order, torch.bincount(flat, minlength=experts).tolist()


def _fused_moe_one_token(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor) -> torch.Tensor:
    """A single token (decode): its k experts one after the other, in the order the grouped path sums them
    (by expert id), skipping the dispatch bookkeeping that costs as much as the GEMVs here. The ids are checked
    from the list read for the loop, and each routing weight is a Python float (a product with it rounds as
    with the 0-dim fp32 tensor: one multiplication in the product's dtype)."""
    ids = topk_ids[0].tolist()
    if ids:
        _require_ids(min(ids), max(ids), w13.shape[0])
    weights = topk_weights[0].float().tolist()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in sorted(range(len(ids)), key=ids.__getitem__):
        out.add_(_swiglu_expert(x, w13[ids[j]], w2[ids[j]]) * weights[j])
    return out if x.dtype == torch.float32 else out.to(x.dtype)


_PLANS = call_plans.Plans(OP)
NATIVE_SOURCE = fused_moe_native.NATIVE_SOURCE


def native_class(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, *args: object, **kwargs: object) -> tuple | None:
    """The shape class kernels/native/dispatch.py measures for tokens the native kernel takes, else None."""
    if fused_moe_native.kernel() is None or not fused_moe_native.takes(x, w13, w2, topk_weights, topk_ids):
        return None
    return dispatch.shape_class(*(() if x.shape[0] == 1 else (x.shape[0], "tokens")), x.shape[1], w13.shape[0],
                                w13.shape[1] // 2, topk_ids.shape[1])


def _grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor) -> torch.Tensor:
    """Several tokens by the torch path: grouped by expert, two products per active expert (module docstring)."""
    _check_ids(topk_ids, w13.shape[0])
    top_k = topk_ids.shape[1]
    order, counts = _dispatch(topk_ids, w13.shape[0])
    token_of = order // top_k
    tokens = x.index_select(0, token_of)                               # grouped by expert
    scale = topk_weights.reshape(-1).float().index_select(0, order).unsqueeze(-1)
    rows = torch.empty(tokens.shape, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            part = slice(start, start + n)
            torch.mul(_swiglu_expert(tokens[part], w13[e], w2[e]), scale[part], out=rows[part])
            start += n
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, token_of, rows).to(x.dtype)


def _fused_moe_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    """The native kernel (token by token) or the torch path (a decode token's experts in turn, several tokens
    grouped by expert), whichever kernels/native/dispatch.py measured faster for the class; decided once per signature
    (kernels/native/call_plans)."""
    args = (x, w13, w2, topk_weights, topk_ids)
    signature = tuple((t.shape, t.stride(), t.dtype, t.is_cpu, t.requires_grad) for t in args)
    plan = _PLANS.get(signature)
    if plan is not None:
        return plan(*args)
    torch_plan = _fused_moe_one_token if x.shape[0] == 1 else _grouped
    cls = native_class(*args)
    if cls is None:
        _PLANS.put(signature, torch_plan)
        return torch_plan(*args)
    native_plan = fused_moe_native.plan(x, w13, w2, topk_ids, functools.partial(_check_ids, experts=w13.shape[0]))
    result = dispatch.run(OP, NATIVE_SOURCE, cls, lambda: native_plan(*args), lambda: torch_plan(*args))
    impl = dispatch.known(OP, cls)
    if impl is not None:
        _PLANS.put(signature, native_plan if impl == "native" else torch_plan)
    return result


@torch.library.custom_op("ascend_dsa::fused_moe", mutates_args=())
@tensors_given
def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Routed SwiGLU experts in one op; see the module docstring."""
    if static_checks_needed():
        _validate(x, w13, w2, topk_weights, topk_ids)
    return _fused_moe_cpu(x, w13, w2, topk_weights, topk_ids)


@fused_moe.register_fake
def _fused_moe_fake(x, w13, w2, topk_weights, topk_ids):
    _validate(x, w13, w2, topk_weights, topk_ids)
    return x.new_empty(x.shape)

"""`ascend_dsa::attn_res` — Kimi block Attention Residuals (AttnRes): softmax attention over depth.

    attn_res(blocks [N,B,T,D], partial [B,T,D] or None, queries [S,D], norm_weight [D] or None, *, eps)
        -> out [S,B,T,D] in blocks' dtype

The values are the N completed block representations v_1..v_N plus, when given, the partial sum of the
current block v_p. Each of the S pseudo-queries w_l (one per layer that reads this depth stack) gives

    out[l] = sum_i softmax_i(w_l . RMSNorm(v_i)) v_i,    RMSNorm(v) = v / sqrt(mean(v^2) + eps) * norm_weight

with the softmax over the depth index i, in fp32 (norm_weight None means no affine scale). The argument
order is the one of DESIGN's op table; tensors cannot be keyword-only in a custom op, so `partial` and
`norm_weight` are positional and may be None.

Non-finite values. A NaN or ±inf in a value v_i (a block or the partial) makes its RMSNorm, hence its logit, NaN:
that token's outputs are NaN for every query. One in a query makes that query's logits NaN or ±inf, one in
norm_weight every query's. Per query and token, as torch.softmax over depth gives it: a NaN or +inf logit makes
the output NaN, a logit of -inf weighs 0, and logits all -inf make it NaN. A value so large that its mean square
overflows (|v| beyond ~1e19) normalizes to 0, as the unfused RMSNorm gives it. Where a logit or a product comes
within rounding of fp32 overflow (values or queries near 3.4e38), whether it overflows depends on the order of
operations, which differs between the paths.

The CPU implementation runs, per tile of tokens, in two phases, as the block form of AttnRes does at
inference:
  (a) `block_phase`: all S queries against all completed blocks at once — one GEMM for the logits
      [N,B*T,S] (the RMSNorm is folded in as a per-row factor, normalized keys are never built), then the
      running max, sum and unnormalized weighted sum per (token, query);
  (b) `merge_partial`: the partial block's logit is merged into those statistics by online softmax,
      without touching the completed blocks again, and the result is normalized.
Phase (a) only depends on the completed blocks, so it can be shared by every layer of a block.
Up to `_DIRECT_ROWS` tokens (decode steps), `direct_phase` instead runs one softmax over all values: the
two-phase statistics cost more calls than they save there. Those rows go to a native kernel when it is built
(kernels/native/attn_res.c, the same one softmax in a single pass over the values: ~42 -> ~8 us a call).
"""
import ctypes
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from npu_graph.kernels.checks import (
    once_per_signature,
    require,
    require_dtype,
    require_rank,
    require_same,
    static_checks_needed,
    tensors_given,
)
from npu_graph.kernels.native import dispatch
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import prototypes as native_prototypes

OP = "attn_res"
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Tokens are processed in tiles of about this many fp32 values of depth stack, so that the fp32 working
# copy of bf16 inputs and the temporaries stay in cache.
_TILE_ELEMENTS = 1 << 20
# Up to this many rows (B*T) both phases run as one softmax over depth (decode steps).
_DIRECT_ROWS = 16
NATIVE_SOURCE = "attn_res"


class DepthStats(NamedTuple):
    """Online-softmax statistics over the blocks seen so far, fp32, tokens flattened to B*T."""
    max: torch.Tensor         # running max of the logits     [B*T, S]
    sum: torch.Tensor         # sum of exp(logit - max)        [B*T, S]
    acc: torch.Tensor         # sum of exp(logit - max) * v    [B*T, S, D]


@once_per_signature
def _validate(blocks: torch.Tensor, partial: torch.Tensor | None, queries: torch.Tensor,
              norm_weight: torch.Tensor | None) -> None:
    require_rank(OP, "blocks", blocks, 4)
    require_dtype(OP, "blocks", blocks, _FLOATS)
    require_rank(OP, "queries", queries, 2)
    require_dtype(OP, "queries", queries, _FLOATS)
    require_same(OP, "hidden size D of `queries` [S,D] and `blocks` [N,B,T,D]", queries.shape[1],
                 blocks.shape[3])
    if partial is not None:
        require_rank(OP, "partial", partial, 3)
        require_same(OP, "shape of `partial` and [B,T,D] of `blocks`", tuple(partial.shape),
                     tuple(blocks.shape[1:]))
        require_same(OP, "dtypes of `partial` and `blocks`", partial.dtype, blocks.dtype)
    else:
        require(blocks.shape[0] > 0, f"{OP}: nothing to attend over: `blocks` has N=0 blocks and "
                                     f"`partial` is None")
    if norm_weight is not None:
        require_rank(OP, "norm_weight", norm_weight, 1)
        require_same(OP, "size of `norm_weight` and hidden size D", norm_weight.shape[0], blocks.shape[3])


def reference_attn_res(blocks: torch.Tensor, partial: torch.Tensor | None, queries: torch.Tensor,
                       norm_weight: torch.Tensor | None = None, *, eps: float = 1e-6) -> torch.Tensor:
    """Naive fp32 form: stack all values, RMSNorm them, softmax over depth, weighted sum."""
    values = blocks.float() if partial is None else torch.cat((blocks.float(), partial.float()[None]))
    keys = values * torch.rsqrt(values.pow(2).mean(dim=-1, keepdim=True) + eps)
    if norm_weight is not None:
        keys = keys * norm_weight.float()
    logits = torch.einsum("sd,nbtd->snbt", queries.float(), keys)
    weights = torch.softmax(logits, dim=1)
    return torch.einsum("snbt,nbtd->sbtd", weights, values).to(blocks.dtype)


def _scaled_queries(queries: torch.Tensor, norm_weight: torch.Tensor | None) -> torch.Tensor:
    """w_l * norm_weight, transposed to [D, S]: w . RMSNorm(v) = (v . (w * norm_weight)) * rms_inv(v)."""
    w = queries.float()
    return (w if norm_weight is None else w * norm_weight.float()).t()


def _logits(values: torch.Tensor, wq_t: torch.Tensor, eps: float) -> torch.Tensor:
    """values [..., D] fp32 -> logits [..., S]."""
    rms_inv = torch.rsqrt(torch.linalg.vector_norm(values, dim=-1).square_() / values.shape[-1] + eps)
    return torch.matmul(values, wq_t).mul_(rms_inv.unsqueeze(-1))


def block_phase(blocks: torch.Tensor, queries: torch.Tensor, norm_weight: torch.Tensor | None = None,
                eps: float = 1e-6) -> DepthStats:
    """Phase (a): statistics of all S queries over the N completed blocks [N,B*T,D], in one batch."""
    n, d = blocks.shape[0], blocks.shape[-1]
    values = blocks.float()
    wq_t = _scaled_queries(queries, norm_weight)
    if n == 0:
        shape = (values.shape[1], wq_t.shape[1])
        return DepthStats(values.new_full(shape, float("-inf")), values.new_zeros(shape),
                          values.new_zeros((*shape, d)))
    logits = _logits(values, wq_t, eps)                                   # [N, BT, S]
    top = logits.amax(dim=0)
    # Blocks whose logits are all -inf weigh 0 (not exp(-inf + inf) = NaN): the partial block's logit decides.
    weights = torch.exp(logits - top.masked_fill(top == float("-inf"), 0.0))
    acc = torch.bmm(weights.permute(1, 2, 0), values.transpose(0, 1))    # [BT, S, D]
    return DepthStats(top, weights.sum(dim=0), acc)


def merge_partial(stats: DepthStats, partial: torch.Tensor | None, queries: torch.Tensor,
                  norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Phase (b): fold the partial block [B*T,D] (or nothing) into `stats`; returns fp32 [S, B*T, D]."""
    acc_t = stats.acc.transpose(0, 1)                                     # [S, BT, D] view
    out = acc_t.new_empty(acc_t.shape)
    if partial is None:
        return torch.div(acc_t, stats.sum.t().unsqueeze(-1), out=out)
    value = partial.float()
    logit = _logits(value, _scaled_queries(queries, norm_weight), eps)   # [BT, S]
    top = torch.maximum(stats.max, logit)
    old, new = torch.exp(stats.max - top), torch.exp(logit - top)
    total = stats.sum * old + new
    torch.mul(acc_t, (old / total).t().unsqueeze(-1), out=out)
    return out.addcmul_(value.unsqueeze(0), (new / total).t().unsqueeze(-1))


def direct_phase(blocks: torch.Tensor, partial: torch.Tensor | None, queries: torch.Tensor,
                 norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Both phases at once for a few rows (decode): one softmax over all N (+1) values; fp32 [S, B*T, D].
    The two-phase form's extra statistics cost more than they save when B*T is small."""
    values = (blocks if partial is None else torch.cat([blocks, partial.unsqueeze(0)])).float()
    logits = _logits(values, _scaled_queries(queries, norm_weight), eps)  # [N(+1), BT, S]
    weights = torch.softmax(logits, dim=0)
    return torch.bmm(weights.permute(1, 2, 0), values.transpose(0, 1)).transpose(0, 1)


@functools.cache
def _typed(lib: ctypes.CDLL) -> tuple[Callable[..., int], bool]:
    has_f16 = native_prototypes.typed(lib, NATIVE_SOURCE, "ar_has_f16")
    return native_prototypes.typed(lib, NATIVE_SOURCE, "ar_rows"), bool(has_f16())


def _native_direct(blocks: torch.Tensor, partial: torch.Tensor | None, queries: torch.Tensor,
                   norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor | None:
    """`direct_phase` in the native kernel ([S,B,T,D] in blocks' dtype), or None where it does not apply
    (no library, values not contiguous on the CPU, fp16 without the compiler's _Float16)."""
    loaded = native.load(NATIVE_SOURCE)
    dtype = blocks.dtype
    if not loaded or dtype not in native.DTYPE_CODES or not blocks.is_cpu or not blocks.is_contiguous() or \
            (partial is not None and (partial.dtype != dtype or not partial.is_contiguous())):
        return None
    fn, has_f16 = _typed(loaded.lib)
    if dtype == torch.float16 and not has_f16:
        return None
    n, b, t, d = blocks.shape
    q = queries.to(torch.float32).contiguous()                          # [S, D]; the kernel folds the norm weight in
    w = None if norm_weight is None else norm_weight.to(torch.float32).contiguous()
    out = torch.empty(q.shape[0], b, t, d, dtype=dtype, device="cpu")
    status = fn(blocks.data_ptr(), None if partial is None else partial.data_ptr(), native.DTYPE_CODES[dtype], n, b * t,
                d, q.data_ptr(), None if w is None else w.data_ptr(), q.shape[0], eps, out.data_ptr())
    return out if status == 0 else None


@torch.library.custom_op("ascend_dsa::attn_res", mutates_args=())
@tensors_given
def attn_res(blocks: torch.Tensor, partial: torch.Tensor | None, queries: torch.Tensor,
             norm_weight: torch.Tensor | None = None, *, eps: float = 1e-6) -> torch.Tensor:
    """Block AttnRes over depth; see the module docstring."""
    if static_checks_needed():
        _validate(blocks, partial, queries, norm_weight)

    def run() -> torch.Tensor:
        return _attn_res_cpu(blocks, partial, queries, norm_weight, eps)

    cls = native_class(blocks, partial, queries)
    return run() if cls is None else dispatch.run(OP, NATIVE_SOURCE, cls, run, dispatch.torch_path(run))


def native_class(blocks: torch.Tensor, partial: torch.Tensor | None, queries: torch.Tensor, *args: object,
                 **kwargs: object) -> tuple | None:
    """The shape class kernels/native/dispatch.py measures for decode-sized rows when the native kernel is loaded, else
    None."""
    n, b, t, d = blocks.shape
    if b * t > _DIRECT_ROWS or not native.load(NATIVE_SOURCE):
        return None
    return dispatch.shape_class(blocks.dtype, n, b * t, d, partial is not None, queries.shape[0])


def _attn_res_cpu(blocks: torch.Tensor, partial: torch.Tensor | None, queries: torch.Tensor,
                  norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    n, b, t, d = blocks.shape
    direct = b * t <= _DIRECT_ROWS and (n > 0 or partial is not None)
    done = _native_direct(blocks, partial, queries, norm_weight, eps) if direct else None
    if done is not None:
        return done
    flat_blocks = blocks.reshape(n, b * t, d)
    flat_partial = None if partial is None else partial.reshape(b * t, d)
    if direct:
        out = direct_phase(flat_blocks, flat_partial, queries, norm_weight, eps).to(blocks.dtype)
        return out.reshape(queries.shape[0], b, t, d).contiguous()
    out = blocks.new_empty(queries.shape[0], b * t, d)
    step = max(1, _TILE_ELEMENTS // max(1, (n + 1) * d))
    for start in range(0, b * t, step):
        rows = slice(start, start + step)
        stats = block_phase(flat_blocks[:, rows], queries, norm_weight, eps)
        part = None if flat_partial is None else flat_partial[rows]
        out[:, rows] = merge_partial(stats, part, queries, norm_weight, eps)
    return out.view(queries.shape[0], b, t, d)


@attn_res.register_fake
def _attn_res_fake(blocks, partial, queries, norm_weight=None, *, eps=1e-6):
    _validate(blocks, partial, queries, norm_weight)
    return blocks.new_empty((queries.shape[0], *tuple(blocks.shape[1:])))

"""Dense attention with small head dims in the CPU runtime.

fuse_attention (and SDPA itself) hand dense softmax attention to torch's CPU flash kernel,
`aten._scaled_dot_product_flash_attention_for_cpu`, which computes its blocks with BLAS calls sized for head dims
of 64 and more, and which needs one head size for q, k and v, so MLA's narrower v is zero-padded to q's head dim
(Kimi Linear and DeepSeek: qk 24 / v 16 in the tiny configs, 192 / 128 in the real ones). native/dense_attention.c
computes scores, online softmax and P.V in registers for head dims up to MAX_HEAD_DIM and takes no part in the
columns of v that are zero in every head. Measured on 2 threads (median of 25 calls each, against torch's kernel
in the same process): [1, 4, 2048, 24] causal with v padded 16 -> 24 6.6 vs 8.5 ms; L 256 1.5x; L 64 1.1x;
head dim 32 at parity; 64 and 128 slower (0.84x, 0.75x), as is a single query row (decode) — those keep torch's.

When the runtime builds a CompiledGraph it binds the generated source's flash calls to `flash_attention_for_cpu`
(`bind`), which checks what torch's kernel assumes (`_checked`: it would crash or read out of bounds), and takes
the native kernel for fp32 CPU tensors with q, k and v of one head dim <= MAX_HEAD_DIM, at
least MIN_QUERIES query rows, no mask, no dropout, unit stride along the head dim and no autograd, and calls torch's
kernel for everything else (and when the library is not built or ASCEND_DSA_NATIVE=0 when the graph is built).
Outputs have torch's layouts (out like q, logsumexp [B, H, L] over a [B, L, H] buffer) and agree with torch's
kernel to fp32 rounding (another summation order and exp); causal attention is top-left aligned, as torch's.

Non-finite values. Both kernels follow IEEE arithmetic: a NaN or +inf logit makes its row's output NaN and its
logsumexp NaN or +inf (as torch's kernel gives it), a -inf logit weighs 0 (a row whose every logit is -inf:
output 0 and logsumexp 0, torch's kernel's convention), and a NaN or inf value row reaches
every output that weighs it. One difference is documented rather than removed: a key or value row that a causal
query cannot see never touches that query in the native kernel, while torch's kernel multiplies whole blocks of
keys and carries a NaN in a masked row into the earlier queries of its block (torch's math path, into all of
them): the native kernel's NaNs are a subset of torch's.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from npu_graph.kernels.native import dispatch
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import prototypes as native_prototypes

NATIVE_SOURCE = "dense_attention"
MAX_HEAD_DIM = 32       # measured: faster up to 24, parity at 32, 0.84x at 64
MIN_QUERIES = 64        # measured: 1.1x at 64 query rows, slower below (threads, packing every key per call)
NAME = "_ascend_dsa_dense_attention"
_CALL = "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default("
_aten_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_F32 = torch.float32
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)     # what torch's kernel computes in
_Strides = ctypes.c_int64 * 3


@native_prototypes.struct(NATIVE_SOURCE, "attention_args")
class _Args(ctypes.Structure):
    """struct attention_args of native/dense_attention.c (its layout is checked against the C by
    tests/kernels/test_native_prototypes.py)."""
    _fields_ = [*((name, ctypes.c_void_p) for name in ("q", "k", "v", "out", "lse")),
                *((name, ctypes.c_int64) for name in ("batch", "hq", "hk", "lq", "lk", "dk", "dv")),
                *((name, _Strides) for name in ("q_stride", "k_stride", "v_stride", "out_stride", "lse_stride")),
                ("scale", ctypes.c_float), ("causal", ctypes.c_int)]


@functools.cache
def _typed(lib: ctypes.CDLL) -> Callable[..., int]:
    return native_prototypes.typed(lib, NATIVE_SOURCE, "da_attention")


def _checked(query: Tensor, key: Tensor, value: Tensor, is_causal: object) -> None:
    """What torch's CPU flash kernel assumes and does not check (a zero head count or a query head count that is
    not a multiple of the key's ends the process with SIGFPE, or reads out of bounds): ValueError naming the
    argument instead."""
    name = "_scaled_dot_product_flash_attention_for_cpu"
    if not isinstance(is_causal, bool):
        raise ValueError(f"{name}: `is_causal` must be a bool, got {is_causal!r}")
    for arg, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: `{arg}` must be a tensor, got {t!r}")
        if t.dim() != 4:
            raise ValueError(f"{name}: `{arg}` must be 4-D [batch, heads, length, head dim], got {tuple(t.shape)}")
    (batch, hq, _, dk), (kb, hk, lk, kd), (vb, hv, lv, vd) = query.shape, key.shape, value.shape
    for arg, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype not in _DTYPES or t.dtype != query.dtype:
            raise ValueError(f"{name}: `{arg}` has dtype {t.dtype}; query, key and value must share one of "
                             f"{', '.join(map(str, _DTYPES))}")
    if (kb, vb) != (batch, batch) or hv != hk or lv != lk:
        raise ValueError(f"{name}: `key` {tuple(key.shape)} and `value` {tuple(value.shape)} must share batch, heads "
                         f"and length, with the batch of `query` {tuple(query.shape)}")
    if kd != dk or vd != dk:
        raise ValueError(f"{name}: `key`'s head dim {kd} and `value`'s {vd} must equal `query`'s {dk} (pad a "
                         f"narrower value with zeros)")
    if (hk == 0 and hq != 0) or (hk and hq % hk):
        raise ValueError(f"{name}: `query`'s {hq} heads must be a multiple of `key`'s {hk} "
                         f"(grouped-query attention)")


def _aten(query: Tensor, key: Tensor, value: Tensor, dropout_p: float, is_causal: bool, attn_mask: Tensor | None,
          scale: float | None) -> tuple[Tensor, Tensor]:
    """torch's kernel, called only with what it handles: checked shapes (`_checked`), rows with unit stride along
    the head dim (its results are wrong otherwise) and no empty dimension (zero query or key length ends the process
    with SIGFPE). Empty attention is SDPA's: output 0, logsumexp -inf where no key exists."""
    _checked(query, key, value, is_causal)
    (batch, hq, lq, _), lk, dv = query.shape, key.shape[2], value.shape[3]
    if 0 in (batch, hq, lq, lk):
        return (query.new_zeros(batch, hq, lq, dv),
                query.new_full((batch, hq, lq), float("-inf") if lk == 0 else 0.0, dtype=_F32))
    query, key, value = (x if x.stride(3) == 1 else x.contiguous() for x in (query, key, value))
    return _aten_flash(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


def _takes(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, attn_mask: Tensor | None, is_causal: object) -> bool:
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)) or attn_mask is not None \
            or dropout_p != 0.0 or q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or not isinstance(is_causal, bool):
        return False
    (batch, hq, lq, dk), (_, hk, lk, _) = q.shape, k.shape
    return (all(x.dtype is _F32 and x.is_cpu and x.stride(3) == 1 for x in (q, k, v))
            and 0 < dk <= MAX_HEAD_DIM and k.shape == v.shape and k.shape[3] == dk and k.shape[0] == batch
            and batch > 0 and lq >= MIN_QUERIES and lk > 0 and hk > 0 and hq % hk == 0
            and not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))))


def _native(kernel: Callable[..., int], q: Tensor, k: Tensor, v: Tensor, is_causal: bool,
            scale: float | None) -> tuple[Tensor, Tensor] | None:
    batch, hq, lq, dk = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(batch, lq, hq, dtype=_F32, device="cpu").transpose(1, 2)
    args = _Args(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                 batch, hq, k.shape[1], lq, k.shape[2], dk, v.shape[3],
                 *(_Strides(*x.stride()[:3]) for x in (q, k, v, out, lse)),
                 dk ** -0.5 if scale is None else scale, int(is_causal))
    return (out, lse) if kernel(ctypes.byref(args)) == 0 else None


def _flash(kernel: Callable[..., int], query: Tensor, key: Tensor, value: Tensor, dropout_p: float = 0.0,
           is_causal: bool = False, *, attn_mask: Tensor | None = None,
           scale: float | None = None) -> tuple[Tensor, Tensor]:
    def aten() -> tuple[Tensor, Tensor]:
        return _aten(query, key, value, dropout_p, is_causal, attn_mask, scale)

    def native_or_aten() -> tuple[Tensor, Tensor]:
        done = _native(kernel, query, key, value, is_causal, scale)
        return aten() if done is None else done

    if not _takes(query, key, value, dropout_p, attn_mask, is_causal):
        return aten()
    cls = dispatch.shape_class(*query.shape, key.shape[1], key.shape[2], value.shape[3], is_causal)
    return dispatch.run("dense_attention", NATIVE_SOURCE, cls, native_or_aten, aten)


def flash_attention_for_cpu(query: Tensor, key: Tensor, value: Tensor, dropout_p: float = 0.0,
                            is_causal: bool = False, *, attn_mask: Tensor | None = None,
                            scale: float | None = None) -> tuple[Tensor, Tensor]:
    """aten._scaled_dot_product_flash_attention_for_cpu's (output, logsumexp), through the native kernel where it
    applies (module docstring), else torch's kernel."""
    loaded = native.load(NATIVE_SOURCE)
    if not loaded:
        return _aten(query, key, value, dropout_p, is_causal, attn_mask, scale)
    return _flash(_typed(loaded.lib), query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


def native_callable() -> Callable[..., Any] | None:
    """What the CPU runtime binds this kernel's ATen calls to (runtime.direct_calls): the native entry, or None
    when the native library is not loaded (or ASCEND_DSA_NATIVE=0 when the graph is loaded)."""
    return native.native_entry(NATIVE_SOURCE, lambda lib: functools.partial(_flash, _typed(lib)))

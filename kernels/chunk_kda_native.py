"""Native KDA recurrence for `ascend_dsa::chunk_kda` (kernels/native/kda.c, built at first use by kernels/native.py).

On a CPU the recurrence itself, run with the state in cache, beats the chunked matrix form: each state column
evolves on its own, so a [K, <= 128] tile of the state stays in cache for the whole sequence and every step costs
three fused multiply-adds per state element (the decay is applied lazily, see kda.c), where the chunked form's
GEMMs and elementwise passes cost more work and stream [T, K] tensors through memory several times (T=4096, H=4,
K=V=128: ~13 vs ~55 ms). The results are the recurrence's, in fp32 (the definition in kernels/chunk_kda.py, up
to summation order).

`kernel()` is None when the library is not loaded (no compiler, ASCEND_DSA_NATIVE=0): the caller keeps its
torch path then, and computes nothing for this one. `recurrence(..., states=buffer)` also writes the state after
each of the first n steps into a caller's `[B, n, H, K, V]` buffer, in the same pass (kda_recurrence_states).
"""
import ctypes
import functools

import torch
from torch import Tensor

from npu_graph.kernels import native, native_prototypes

NATIVE_SOURCE = "kda"


@functools.cache
def _typed(lib: ctypes.CDLL) -> ctypes._CFuncPtr:
    return native_prototypes.typed(lib, NATIVE_SOURCE, "kda_recurrence_states")


def _fp32(x: Tensor) -> Tensor:
    return x.to(torch.float32).contiguous()


def kernel() -> ctypes._CFuncPtr | None:
    """The native recurrence, or None (module docstring)."""
    loaded = native.load(NATIVE_SOURCE)
    return _typed(loaded.lib) if loaded else None


def recurrence(fn: ctypes._CFuncPtr, q: Tensor, k: Tensor, v: Tensor, exp_g: Tensor, beta: Tensor, scale: float,
               state: Tensor, states: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """o [B,T,H,V] fp32 and the final state through `kernel()`'s fn. q, k, exp_g [B,T,H,K], v [B,T,H,V],
    beta [B,T,H]; exp_g is exp of the log decay; state [B*H, K, V] fp32 contiguous, updated in place; `states`
    (optional, fp32 contiguous [B, n, H, K, V], n <= T) receives the state after each of the first n steps."""
    b, t_len, h, dk = k.shape
    dv = v.shape[-1]
    q, k, exp_g, v, beta = (_fp32(x) for x in (q, k, exp_g, v, beta))
    o = torch.empty(b, t_len, h, dv, dtype=torch.float32, device="cpu")
    if states is not None and not (states.dtype == torch.float32 and states.is_contiguous()
                                   and tuple(states.shape) == (b, states.shape[1], h, dk, dv)
                                   and states.shape[1] <= t_len):
        raise ValueError(f"chunk_kda: the checkpoint buffer must be fp32, contiguous, [B, n <= T, H, K, V] = "
                         f"[{b}, <= {t_len}, {h}, {dk}, {dv}]; got {states.dtype} {tuple(states.shape)}")
    n_states = 0 if states is None else states.shape[1]
    if fn(q.data_ptr(), k.data_ptr(), exp_g.data_ptr(), v.data_ptr(), beta.data_ptr(), scale, b, t_len, h, dk, dv,
          state.data_ptr(), o.data_ptr(), 0 if states is None else states.data_ptr(), n_states):
        raise MemoryError(f"chunk_kda: the native kernel could not allocate its state tiles; set "
                          f"{native.ENV_SWITCH}=0 to use the torch path")
    return o, state

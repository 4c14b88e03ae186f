"""Native KDA recurrence for `ascend_dsa::chunk_kda` (kernels/native/kda.c, built at first use by
kernels/native/loader.py).

On a CPU the recurrence itself, run with the state in cache, beats the chunked matrix form: each state column
evolves on its own, so a [K, <= 128] tile of the state stays in cache for the whole sequence and every step costs
three fused multiply-adds per state element (the decay is applied lazily, see kda.c), where the chunked form's
GEMMs and elementwise passes cost more work and stream [T, K] tensors through memory several times (T=4096, H=4,
K=V=128: ~13 vs ~55 ms). The results are the recurrence's, in fp32 (the definition in kernels/kda/chunk_kda.py, up
to summation order).

`kernel()` is None when the library is not loaded (no compiler, ASCEND_DSA_NATIVE=0): the caller keeps its
torch path then, and computes nothing for this one. The kernel takes the op's log decay as it is (checks it,
floors it and exponentiates it in one vectorized pass) and copies the initial state itself: a decode step's call
is one kernel call and two allocations, not a dozen small torch ops. `recurrence(..., states=buffer)` also writes
the state after each of the first n steps into a caller's `[B, n, H, K, V]` buffer, in the same pass.
"""
import ctypes
import functools

import torch
from torch import Tensor

from npu_graph.kernels.kda.checks import FLOOR_EXPONENT, checked_log_decay
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import prototypes as native_prototypes

NATIVE_SOURCE = "kda"


@functools.cache
def _typed(lib: ctypes.CDLL) -> ctypes._CFuncPtr:
    return native_prototypes.typed(lib, NATIVE_SOURCE, "kda_call")


_GROWING_DECAY = 2      # kda_call's code for a log decay g > 0


def _fp32(x: Tensor) -> Tensor:
    return x if x.dtype is torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()


def kernel() -> ctypes._CFuncPtr | None:
    """The native recurrence, or None (module docstring)."""
    loaded = native.load(NATIVE_SOURCE)
    return _typed(loaded.lib) if loaded else None


def recurrence(fn: ctypes._CFuncPtr, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
               initial_state: Tensor | None, states: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """o [B,T,H,V] fp32 and the final state [B*H, K, V] fp32 (a new tensor) through `kernel()`'s fn. q, k, g
    [B,T,H,K], v [B,T,H,V], beta [B,T,H]; g is the log decay (a g > 0 is refused with kernels/kda/checks.py's message;
    floored at FLOOR_EXPONENT and exponentiated by the kernel); initial_state [B,H,K,V] or None (zeros), never written;
    `states` (optional, fp32 contiguous [B, n, H, K, V], n <= T) receives the state after each of the first n
    steps."""
    b, t_len, h, dk = k.shape
    dv = v.shape[-1]
    o = torch.empty(b, t_len, h, dv, dtype=torch.float32, device="cpu")
    state = torch.empty(b * h, dk, dv, dtype=torch.float32, device="cpu")
    if states is not None and not (states.dtype == torch.float32 and states.is_contiguous()
                                   and tuple(states.shape) == (b, states.shape[1], h, dk, dv)
                                   and states.shape[1] <= t_len):
        raise ValueError(f"chunk_kda: the checkpoint buffer must be fp32, contiguous, [B, n <= T, H, K, V] = "
                         f"[{b}, <= {t_len}, {h}, {dk}, {dv}]; got {states.dtype} {tuple(states.shape)}")
    q, k, g, v, beta = _fp32(q), _fp32(k), _fp32(g), _fp32(v), _fp32(beta)    # held until the kernel returns
    initial = None if initial_state is None else _fp32(initial_state)
    status = fn(q.data_ptr(), k.data_ptr(), g.data_ptr(), FLOOR_EXPONENT, v.data_ptr(), beta.data_ptr(), scale, b,
                t_len, h, dk, dv, None if initial is None else initial.data_ptr(), state.data_ptr(), o.data_ptr(),
                None if states is None else states.data_ptr(), 0 if states is None else states.shape[1])
    if status == _GROWING_DECAY:
        checked_log_decay(g)                # raises with the position of a positive g
    if status:
        raise MemoryError(f"chunk_kda: the native kernel could not allocate its buffers; set "
                          f"{native.ENV_SWITCH}=0 to use the torch path")
    return o, state

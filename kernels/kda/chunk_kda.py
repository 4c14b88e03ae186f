"""`ascend_dsa::chunk_kda` — Kimi Delta Attention (KDA), the gated delta rule with per-channel decay.

Layout follows fla's `chunk_kda`: q, k [B,T,H,K], v [B,T,H,V], g [B,T,H,K] (log-space decay, <= 0; -inf resets
the state; a positive g is refused),
beta [B,T,H], initial_state [B,H,K,V] fp32. Per head and step t (S is [K,V]):

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (q_t * scale)                                  scale defaults to K ** -0.5

Outputs `(o, final_state)`: o [B,T,H,V] in v's dtype; final_state [B,H,K,V] fp32 when
`output_final_state`, else an empty fp32 tensor of shape [0] (a custom op cannot return None).

CPU paths, all in fp32. Where the native library is built (kernels/kda/native.py), the recurrence itself
runs in C with the state in cache: on a CPU that beats the chunked form (kernels/kda/chunked.py; T=4096, H=4,
K=V=128: ~13 vs ~55 ms), which is what the NPU kernels run and what the torch path runs without a C compiler.
Argument checks are in kernels/kda/checks.py.

Non-finite values. `scale` must be finite (else ValueError). g = -inf resets the state (every path floors g at
e**-80, zero at fp32 precision); g = +inf is refused as every positive g is. Otherwise a NaN or ±inf at step t of
k, v, g or beta, or in the initial state, makes the state of its batch row and head, and so its outputs, NaN or
±inf from step t on (as IEEE arithmetic gives them: the same positions on every path and in the definition); one
in q reaches that step's output only. Earlier outputs never change: inputs that are not all finite, and finite
ones whose chunked form overflows, take the step recurrence, as the chunked form's GEMMs would carry inf · 0 = NaN
back to the earlier steps of a chunk. Where a product or sum comes within rounding of fp32 overflow (values near
3.4e38), whether it overflows depends on the order of operations, which differs between the paths.

`chunk_size` (a power of two) changes speed, not results; T need not be a multiple of it. Without the native
library, sequences of at most RECURRENT_MAX_T steps (decode) run the recurrence step by step in torch instead
(fla's fused_recurrent_kda).

`ascend_dsa::chunk_kda_states` (inference only) is chunk_kda that also returns the state after each of the first
`num_states` steps, `[B, n, H, K, V]` fp32, computed in the same pass (speculative decoding keeps them as
checkpoints and rolls back by picking one): the native recurrence writes them as it goes, the torch path runs
the step recurrence. Checkpoint t is bitwise the final state of the same path over the first t + 1 steps.

`kda_transition` exposes the affine map of a whole segment, used to fold states across ranks when a
sequence is split: final_state(S0) = A @ S0 + final_state(0).
"""
import math

import torch

from npu_graph.kernels.checks import static_checks_needed, tensors_given
from npu_graph.kernels.kda import grad as chunk_kda_grad
from npu_graph.kernels.kda import native as chunk_kda_native
from npu_graph.kernels.kda.checks import OP, check_scale, checked_log_decay, validate, validate_states
from npu_graph.kernels.kda.chunked import chunked
from npu_graph.kernels.kda.chunked import kda_transition as kda_transition
from npu_graph.kernels.native import call_plans, dispatch
from npu_graph.kernels.native import loader as native

# Sequences up to this long (decode, speculative tokens) run step by step: the chunked form pads them to a whole
# chunk (H=8, K=V=64: T=1 0.13 vs 1.23 ms, T=16 0.74 vs 1.25 ms; the step cost grows ~45 us per token).
RECURRENT_MAX_T = 16


def reference_chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, *, scale: float | None = None,
                        initial_state: torch.Tensor | None = None,
                        output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence, one step at a time, in fp32 (slow, readable)."""
    check_scale(scale)
    b, t_len, h, dk = k.shape
    scale = dk ** -0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    state = (torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32) if initial_state is None
             else initial_state.float().clone())
    outs = []
    for t in range(t_len):
        state = state * g[:, t].exp().unsqueeze(-1)                          # Diag(exp g_t) S
        k_t = k[:, t]
        correction = v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, state)     # v_t - k_t^T D S
        state = state + beta[:, t, :, None, None] * k_t.unsqueeze(-1) * correction.unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, state))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o.to(out_dtype), state if output_final_state else state.new_empty(0)


def _recurrent_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float, state: torch.Tensor, states: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A few steps (decode) one at a time on all heads at once, in fp32: q, k, g [B,T,H,K], v [B,T,H,V],
    beta [B,T,H], state [B*H, K, V] (updated in place). Returns o [B,T,H,V] fp32 and the state; `states`
    [B, n, H, K, V] (optional) receives the state after each of the first n steps."""
    b, t_len, h, dk = k.shape
    dv = v.shape[-1]
    steps = torch.empty(t_len, b * h, 1, dv, dtype=torch.float32)
    for t in range(t_len):
        k_t = k[:, t].float().reshape(b * h, 1, dk)
        state.mul_(g[:, t].float().exp().reshape(b * h, dk, 1))
        delta = torch.baddbmm(v[:, t].float().reshape(b * h, 1, dv), k_t, state, alpha=-1.0)
        delta.mul_(beta[:, t].float().reshape(b * h, 1, 1))
        state.baddbmm_(k_t.transpose(1, 2), delta)
        torch.bmm(q[:, t].float().reshape(b * h, 1, dk) * scale, state, out=steps[t])
        if states is not None and t < states.shape[1]:
            states[:, t].copy_(state.view(b, h, dk, dv))
    return steps.view(t_len, b, h, dv).transpose(0, 1).contiguous(), state


def _all_finite(*tensors: torch.Tensor) -> bool:
    """Whether no tensor holds inf or NaN, read off their fp32 sums: a reduction without isfinite's mask (the
    fp32 inputs of T=4096, H=4, K=V=128: 62 -> 1.3 ms on an AMD EPYC, 2 threads); a sum that overflows reads as
    non-finite, which only sends the call to the step recurrence. The chunked form mixes the steps of a chunk in
    GEMMs, where a non-finite value at one step times a zero coefficient reaches earlier steps (inf * 0 = NaN);
    the step recurrence, like the native kernel and the definition, carries it only forward in time."""
    return all(math.isfinite(float(t.sum(dtype=torch.float32))) for t in tensors)


def _chunk_kda_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   scale: float | None, initial_state: torch.Tensor | None, output_final_state: bool,
                   chunk_size: int, states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's CPU work; `states` (fp32 contiguous [B, n, H, K, V], n <= T, optional) receives the state after
    each of the first n steps, written by the native recurrence or the torch step loop in the same pass."""
    b, _, h, dk = k.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    native_fn = chunk_kda_native.kernel() if dv else None
    if native_fn is not None:        # a new state: never the caller's
        o, final = chunk_kda_native.recurrence(native_fn, q, k, v, g, beta, scale, initial_state, states)
    else:
        o, final = _torch_recurrence(q, k, v, g, beta, scale, initial_state, chunk_size, states)
    final = final.view(b, h, dk, dv) if output_final_state else final.new_empty(0)
    return o if o.dtype is v.dtype else o.to(v.dtype), final


def _torch_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      scale: float, initial_state: torch.Tensor | None, chunk_size: int,
                      states: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`_chunk_kda_cpu`'s torch paths: (o [B,T,H,V], final state [B*H, K, V] fp32, a copy of the caller's)."""
    b, t_len, h, dk = k.shape
    dv = v.shape[-1]
    state = k.new_zeros(b * h, dk, dv, dtype=torch.float32) if initial_state is None \
        else initial_state.reshape(b * h, dk, dv)
    own_state = state if initial_state is None else state.to(torch.float32, copy=True).contiguous()
    g = checked_log_decay(g)
    if dv == 0:             # no values: empty outputs, and a state with no columns stays as it is
        return v.new_zeros(b, t_len, h, 0), own_state
    if states is not None or t_len <= RECURRENT_MAX_T or not _all_finite(q, k, v, g, beta, state):
        return _recurrent_steps(q, k, v, g, beta, scale, own_state, states)
    o, final = chunked(q, k, v, g, beta, scale, state, chunk_size)
    if _all_finite(o, final):
        return o, final
    # Finite inputs that overflow: in the chunked form the overflow reaches the earlier steps of its chunk too.
    return _recurrent_steps(q, k, v, g, beta, scale, own_state, states)


@torch.library.custom_op("ascend_dsa::chunk_kda", mutates_args=())
@tensors_given
def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None, *,
              output_final_state: bool = False, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over a whole sequence; see the module docstring for the recurrence and layouts."""
    if static_checks_needed():
        validate(q, k, v, g, beta, initial_state, chunk_size)
        check_scale(scale)
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)
    signature = (*map(call_plans.tensor_key, (q, k, v, g, beta, initial_state)), scale, output_final_state,
                 chunk_size)
    plan = _PLANS.get(signature)
    if plan is not None:
        return plan(*args)
    cls = native_class(q, k, v, g, beta)
    if cls is None:
        _PLANS.put(signature, _chunk_kda_cpu)
        return _chunk_kda_cpu(*args)
    result = dispatch.run(OP, chunk_kda_native.NATIVE_SOURCE, cls, lambda: _chunk_kda_cpu(*args),
                          dispatch.torch_path(lambda: _chunk_kda_cpu(*args)))
    impl = dispatch.known(OP, cls)
    if impl is not None:        # a decode step's call costs more in these decisions than in its one step
        _PLANS.put(signature, _chunk_kda_cpu if impl == "native" else call_plans.without_native(_chunk_kda_cpu))
    return result


_PLANS = call_plans.Plans(OP)


chunk_kda_grad.register(chunk_kda)


def native_class(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 *args: object, **kwargs: object) -> tuple | None:
    """The shape class kernels/native/dispatch.py measures when the native recurrence is loaded, else None."""
    if not native.load(chunk_kda_native.NATIVE_SOURCE) or v.shape[-1] == 0:
        return None
    return dispatch.shape_class(v.dtype, *k.shape[1:], v.shape[-1])


@chunk_kda.register_fake
def _chunk_kda_fake(q, k, v, g, beta, scale=None, initial_state=None, *, output_final_state=False,
                    chunk_size=64):
    validate(q, k, v, g, beta, initial_state, chunk_size)
    check_scale(scale)
    b, t_len, h, dk = k.shape
    o = v.new_empty(b, t_len, h, v.shape[-1])
    final = k.new_empty(b, h, dk, v.shape[-1], dtype=torch.float32) if output_final_state \
        else k.new_empty(0, dtype=torch.float32)
    return o, final


@torch.library.custom_op("ascend_dsa::chunk_kda_states", mutates_args=())
@tensors_given
def chunk_kda_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float | None = None, initial_state: torch.Tensor | None = None, *, num_states: int,
                     chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chunk_kda's (o, final_state) and the state after each of the first `num_states` steps `[B, n, H, K, V]`
    fp32, from one pass over the tokens (module docstring). Inference only: it has no gradient."""
    validate_states(q, k, v, g, beta, initial_state, chunk_size, num_states)
    check_scale(scale)
    b, _, h, dk = k.shape

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        states = torch.empty(b, num_states, h, dk, v.shape[-1], dtype=torch.float32)
        o, final = _chunk_kda_cpu(q, k, v, g, beta, scale, initial_state, True, chunk_size, states)
        return o, final, states

    cls = native_class(q, k, v, g, beta)
    return run() if cls is None else dispatch.run(OP, chunk_kda_native.NATIVE_SOURCE, cls, run,
                                                  dispatch.torch_path(run))


@chunk_kda_states.register_fake
def _chunk_kda_states_fake(q, k, v, g, beta, scale=None, initial_state=None, *, num_states, chunk_size=64):
    validate_states(q, k, v, g, beta, initial_state, chunk_size, num_states)
    check_scale(scale)
    b, t_len, h, dk = k.shape
    dv = v.shape[-1]
    return (v.new_empty(b, t_len, h, dv), k.new_empty(b, h, dk, dv, dtype=torch.float32),
            k.new_empty(b, num_states, h, dk, dv, dtype=torch.float32))

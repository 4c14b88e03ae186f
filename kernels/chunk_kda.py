"""`ascend_dsa::chunk_kda` — Kimi Delta Attention (KDA), the gated delta rule with per-channel decay.

Layout follows fla's `chunk_kda`: q, k [B,T,H,K], v [B,T,H,V], g [B,T,H,K] (log-space decay, <= 0; -inf resets
the state; a positive g is refused),
beta [B,T,H], initial_state [B,H,K,V] fp32. Per head and step t (S is [K,V]):

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (q_t * scale)                                  scale defaults to K ** -0.5

Outputs `(o, final_state)`: o [B,T,H,V] in v's dtype; final_state [B,H,K,V] fp32 when
`output_final_state`, else an empty fp32 tensor of shape [0] (a custom op cannot return None).

CPU paths, all in fp32. Where the native library is built (kernels/chunk_kda_native.py), the recurrence itself
runs in C with the state in cache: on a CPU that beats the chunked form below (T=4096, H=4, K=V=128: ~13 vs
~55 ms), which is what the NPU kernels run and what the torch path runs without a C compiler.

Chunked form (WY / UT-transform). Inside a chunk of C steps, with
G_r the cumulative decay from the chunk start and S the state entering the chunk:

    A[r,j] = beta_r sum_c k_r[c] k_j[c] exp(G_r[c] - G_j[c])          (j < r)
    [W_v | W_k] = (I + A)^-1 [beta V | beta K * exp(G)]              (one blocked inverse, one GEMM)
    U = W_v - W_k S,  o = (q * exp(G)) S + M U,  M[r,j] = sum_c q_r[c] k_j[c] exp(G_r[c] - G_j[c]) (j <= r)
    S' = Diag(exp G_last) S + (K * exp(G_last - G))^T U

All of it except the two state GEMMs is computed for all chunks and heads at once; a loop over chunks
carries the state. The pairwise decays exp(G_r - G_j) are never formed as a [C,C,K] tensor: they are
split as exp(G_r - G_m) * exp(G_m - G_j) around a reference step m and contracted with GEMMs, where m is
chosen so that no factor leaves the normal fp32 range (see `_decayed_gram`), so any g <= 0 is safe.

Non-finite values: an inf or NaN in q, k, v, beta, g or the initial state at step t makes the outputs (and the
state) from step t on non-finite and leaves every earlier output as it would be; all CPU paths and the
definition agree (inputs that are not all finite take the step recurrence instead of the chunked form).

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
from typing import NamedTuple

import torch

from npu_graph.kernels import chunk_kda_grad, chunk_kda_native, dispatch, native
from npu_graph.kernels.checks import (
    require,
    require_dtype,
    require_positive,
    require_rank,
    require_same,
    static_checks_needed,
)

OP = "chunk_kda"
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Largest |exponent| allowed in one factor of a split decay: e**60 and e**-60 are normal fp32 numbers.
_SAFE_EXPONENT = 60.0
# Decays below e**-80 (< 2e-35) are held there: exp() of underflowing inputs is several times slower.
_FLOOR_EXPONENT = -80.0
# Sequences up to this long (decode, speculative tokens) run step by step: the chunked form pads them to a whole
# chunk (H=8, K=V=64: T=1 0.13 vs 1.23 ms, T=16 0.74 vs 1.25 ms; the step cost grows ~45 us per token).
RECURRENT_MAX_T = 16


def _validate(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, initial_state: torch.Tensor | None, chunk_size: int) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g)):
        if t is not None:
            require_rank(OP, name, t, 4)
            require_dtype(OP, name, t, _FLOATS)
    require_rank(OP, "beta", beta, 3)
    require_dtype(OP, "beta", beta, _FLOATS)
    if q is not None:
        require_same(OP, "shapes of `q` and `k` [B,T,H,K]", tuple(q.shape), tuple(k.shape))
    require_same(OP, "shapes of `g` and `k` [B,T,H,K]", tuple(g.shape), tuple(k.shape))
    require_same(OP, "[B,T,H] of `v` and `k`", tuple(v.shape[:3]), tuple(k.shape[:3]))
    require_same(OP, "shape of `beta` and [B,T,H] of `k`", tuple(beta.shape), tuple(k.shape[:3]))
    require(k.shape[3] > 0, f"{OP}: the head dim K of `k` [B,T,H,K] is 0; KDA needs K >= 1 (its default scale is "
                            f"K ** -0.5)")
    require_positive(OP, "chunk_size", chunk_size)
    require(chunk_size & (chunk_size - 1) == 0, f"{OP}: `chunk_size` must be a power of two, got {chunk_size}")
    if initial_state is not None:
        b, _, h, dk = k.shape
        want = (b, h, dk, v.shape[-1])
        require_same(OP, "shape of `initial_state` and [B,H,K,V]", tuple(initial_state.shape), want)
        require_dtype(OP, "initial_state", initial_state, (torch.float32,))


def reference_chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, *, scale: float | None = None,
                        initial_state: torch.Tensor | None = None,
                        output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence, one step at a time, in fp32 (slow, readable)."""
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


def _to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[B,T,H,*D] -> fp32 [N, B*H, C, *D], chunk-major, zero-padded at the end of T."""
    b, t_len, h = x.shape[:3]
    rest = tuple(x.shape[3:])
    full, tail = divmod(t_len, chunk)
    out = x.new_empty((full + (tail > 0), b, h, chunk, *rest), dtype=torch.float32)
    src = x[:, :full * chunk].reshape((b, full, chunk, h, *rest))
    out[:full].copy_(src.transpose(0, 1).transpose(2, 3))
    if tail:
        out[full, :, :, :tail].copy_(x[:, full * chunk:].transpose(1, 2))
        out[full, :, :, tail:].zero_()
    return out.view((out.shape[0], b * h, chunk, *rest))


def _exp_decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp of a log-decay <= 0, floored at exp(_FLOOR_EXPONENT) (no change at fp32 precision)."""
    return log_decay.clamp(min=_FLOOR_EXPONENT).exp_()


def _write_blocks(out: torch.Tensor, blocks: torch.Tensor, seg: int, rows: slice, cols: slice) -> None:
    """Write blocks [..., S, r, c] into the diagonal segments (size `seg`) of out [..., C, C]."""
    lead, c = out.shape[:-2], out.shape[-1]
    s = c // seg
    diag = out.view(*lead, s, seg, s, seg).diagonal(dim1=-4, dim2=-2)      # [..., seg, seg, S]
    diag[..., rows, cols, :] = blocks.movedim(-3, -1)


def _decayed_gram(rows: list[torch.Tensor], y: torch.Tensor, gc: torch.Tensor) -> list[torch.Tensor]:
    """For each x in rows: out[..., r, j] = sum_c x[..., r, c] y[..., j, c] exp(gc[..., r, c] - gc[..., j, c])
    for j <= r, else 0.

    x, y and gc are [Bt, C, K], gc non-increasing along C. A segment whose decay range fits in
    +-_SAFE_EXPONENT around its middle step m is done with one GEMM of x*exp(gc-gc_m) by y*exp(gc_m-gc).
    Otherwise the segment is halved: the (right half x left half) block uses the split point p as
    reference, where both factors exp(gc_r - gc_p) and exp(gc_p - gc_j) are <= 1, and the halves recurse.
    """
    bt, c, kd = y.shape
    if bt == 0:
        return [y.new_empty(0, c, c) for _ in rows]
    outs: list[torch.Tensor] = []
    n = c
    while True:
        s = c // n
        ys, gs = y.view(bt, s, n, kd), gc.view(bt, s, n, kd)
        ref = gs[:, :, n // 2: n // 2 + 1]
        span = torch.maximum(gs[:, :, :1] - ref, ref - gs[:, :, -1:]).max().item() if n > 1 else 0.0
        if span <= _SAFE_EXPONENT:
            e = torch.exp(gs - ref)
            cols = (ys / e).transpose(-1, -2)
            blocks = [torch.matmul(x.view(bt, s, n, kd) * e, cols).tril_() for x in rows]
            if not outs:
                return [block.view(bt, c, c) for block in blocks]
            for out, block in zip(outs, blocks):
                _write_blocks(out, block, n, slice(None), slice(None))
            return outs
        outs = outs or [y.new_zeros(bt, c, c) for _ in rows]
        h = n // 2
        pivot = gs[:, :, h - 1: h]
        right = _exp_decay(gs[:, :, h:] - pivot)
        cols = (ys[:, :, :h] * _exp_decay(pivot - gs[:, :, :h])).transpose(-1, -2)
        for out, x in zip(outs, rows):
            block = torch.matmul(x.view(bt, s, n, kd)[:, :, h:] * right, cols)
            _write_blocks(out, block, n, slice(h, None), slice(None, h))
        n = h


class _Intra(NamedTuple):
    """State-independent per-chunk tensors, [N, B*H, ...]."""
    w_v: torch.Tensor         # (I + A)^-1 beta V                         [.., C, V]
    w_k: torch.Tensor         # (I + A)^-1 beta K exp(G)                  [.., C, K]
    k_tail: torch.Tensor      # (K exp(G_last - G))^T                     [.., K, C]
    decay: torch.Tensor       # exp(G_last)                               [.., K, 1]
    q_decay: torch.Tensor     # q scale exp(G); empty without q           [.., C, K]
    m_qk: torch.Tensor        # M (lower triangular); empty without q     [.., C, C]


def _unit_lower_inverse(a: torch.Tensor, block: int = 8) -> torch.Tensor:
    """(I + a)^-1 for strictly lower triangular a [Bt, C, C]. The diagonal blocks are inverted by row
    substitution on all blocks at once; the off-diagonal blocks follow by block forward substitution
    (several times faster than a batched triangular solve for these small matrices)."""
    bt, c, _ = a.shape
    block = min(block, c)
    nb = c // block
    diag = a.view(bt, nb, block, nb, block).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(-1, block, block)
    inv_diag = a.new_zeros(bt * nb, block, block)
    inv_diag[:, 0, 0] = 1.0
    for r in range(1, block):
        inv_diag[:, r, :r] = torch.bmm(diag[:, r:r + 1, :r], inv_diag[:, :r, :r]).squeeze(1).neg_()
        inv_diag[:, r, r] = 1.0
    inv_diag = inv_diag.view(bt, nb, block, block)
    out = a.new_zeros(bt, c, c)
    for i in range(nb):
        rows = slice(i * block, (i + 1) * block)
        out[:, rows, rows] = inv_diag[:, i]
        if i:
            below = torch.bmm(a[:, rows, :i * block], out[:, :i * block, :i * block])
            out[:, rows, :i * block] = torch.bmm(inv_diag[:, i], below).neg_()
    return out


def _intra(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           q: torch.Tensor | None) -> _Intra:
    """All chunks at once: decays, the UT-transform solve, and (when q is given) the output matrices."""
    n, bh, c, kd = k.shape
    dv = v.shape[-1]
    flat = (n * bh, c)
    gc = g.cumsum(dim=2).view(*flat, kd)
    kf = k.view(*flat, kd)
    grams = _decayed_gram([kf] if q is None else [kf, q.view(*flat, kd)], kf, gc)
    b_col = beta.view(*flat, 1)
    exp_g = _exp_decay(gc)
    inverse = _unit_lower_inverse(grams[0].mul_(b_col))
    rhs = kf.new_empty(*flat, dv + kd)
    torch.mul(v.view(*flat, dv), b_col, out=rhs[..., :dv])
    torch.mul(kf, exp_g, out=rhs[..., dv:]).mul_(b_col)
    w_v, w_k = torch.bmm(inverse, rhs).split([dv, kd], dim=-1)
    g_last = gc[:, -1:, :]
    k_tail = kf.new_empty(n * bh, kd, c)
    torch.mul(kf, _exp_decay(g_last - gc), out=k_tail.transpose(-1, -2))
    q_decay = q.view(*flat, kd) * exp_g if q is not None else exp_g.new_empty(0)
    m_qk = grams[1] if q is not None else exp_g.new_empty(0)
    shaped = [t.reshape(n, bh, *t.shape[1:]) if t.numel() else t
              for t in (w_v, w_k, k_tail, _exp_decay(g_last).transpose(-1, -2), q_decay, m_qk)]
    return _Intra(*shaped)


def _scan(intra: _Intra, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Carry the state [B*H, K, V] over the chunks: returns the final state, the states entering the
    chunks [N, B*H, K, V] and U = W_v - W_k S of every chunk [N, B*H, C, V]."""
    n = intra.w_v.shape[0]
    states = state.new_empty((n + 1, *state.shape))
    states[0] = state
    us = intra.w_v.clone()
    for i in range(n):
        us[i].baddbmm_(intra.w_k[i], states[i], alpha=-1.0)
        torch.mul(states[i], intra.decay[i], out=states[i + 1]).baddbmm_(intra.k_tail[i], us[i])
    return states[n].clone(), states[:n], us


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


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
             state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form (module docstring): o [B,T,H,V] fp32 and the final state [B*H, K, V]."""
    b, t_len, h, _ = k.shape
    dv = v.shape[-1]
    qc = _to_chunks(q, chunk_size).mul_(scale)
    kc, vc, gc, bc = (_to_chunks(x, chunk_size) for x in (k, v, g, beta))
    intra = _intra(kc, vc, gc, bc, qc)
    final, entering, us = _scan(intra, state)
    n, c = kc.shape[0], chunk_size
    o = torch.matmul(intra.q_decay, entering).view(n * b * h, c, dv)
    o = torch.baddbmm(o, intra.m_qk.view(-1, c, c), us.view(-1, c, dv))
    return o.view(n, b, h, c, dv).permute(1, 0, 3, 2, 4).reshape(b, n * c, h, dv)[:, :t_len], final


def _checked_log_decay(g: torch.Tensor) -> torch.Tensor:
    """g in fp32, floored at _FLOOR_EXPONENT (so -inf, a full reset, is e**-80: zero at fp32 precision in every
    path); a positive log decay (a state that grows) is refused."""
    g = g.float()
    if bool((g > 0).any()):
        where = [int(i) for i in (g > 0).nonzero()[0]]
        raise ValueError(f"{OP}: `g` is a log decay and must be <= 0 (or -inf); g{where} = {float(g[tuple(where)])}")
    return g.clamp(min=_FLOOR_EXPONENT)


def _all_finite(*tensors: torch.Tensor) -> bool:
    """Whether no input holds inf or NaN. The chunked form mixes the steps of a chunk in GEMMs, where a
    non-finite value at one step times a zero coefficient reaches earlier steps (inf * 0 = NaN); the step
    recurrence, like the native kernel and the definition, carries it only forward in time."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _chunk_kda_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   scale: float | None, initial_state: torch.Tensor | None, output_final_state: bool,
                   chunk_size: int, states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's CPU work; `states` (fp32 contiguous [B, n, H, K, V], n <= T, optional) receives the state after
    each of the first n steps, written by the native recurrence or the torch step loop in the same pass."""
    b, t_len, h, dk = k.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    state = k.new_zeros(b * h, dk, dv, dtype=torch.float32) if initial_state is None \
        else initial_state.reshape(b * h, dk, dv)
    own_state = state if initial_state is None else state.to(torch.float32, copy=True).contiguous()
    g = _checked_log_decay(g)
    if dv == 0:             # no values: empty outputs, and a state with no columns stays as it is
        return v.new_zeros(b, t_len, h, 0), own_state.view(b, h, dk, 0) if output_final_state \
            else own_state.new_empty(0)
    native_fn = chunk_kda_native.kernel()
    if native_fn is not None:        # both update the state in place: never the caller's
        o, final = chunk_kda_native.recurrence(native_fn, q, k, v, g.exp(), beta, scale, own_state, states)
    elif states is not None or t_len <= RECURRENT_MAX_T or not _all_finite(q, k, v, g, beta, state):
        o, final = _recurrent_steps(q, k, v, g, beta, scale, own_state, states)
    else:
        o, final = _chunked(q, k, v, g, beta, scale, state, chunk_size)
    final = final.view(b, h, dk, dv) if output_final_state else final.new_empty(0)
    return o.to(v.dtype).contiguous(), final


@torch.library.custom_op("ascend_dsa::chunk_kda", mutates_args=())
def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None, *,
              output_final_state: bool = False, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over a whole sequence; see the module docstring for the recurrence and layouts."""
    if static_checks_needed():
        _validate(q, k, v, g, beta, initial_state, chunk_size)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return _chunk_kda_cpu(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)

    cls = native_class(q, k, v, g, beta)
    return run() if cls is None else dispatch.run(OP, chunk_kda_native.NATIVE_SOURCE, cls, run,
                                                  dispatch.torch_path(run))


chunk_kda_grad.register(chunk_kda)


def native_class(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 *args: object, **kwargs: object) -> tuple | None:
    """The shape class kernels/dispatch.py measures when the native recurrence is loaded, else None."""
    if not native.load(chunk_kda_native.NATIVE_SOURCE) or v.shape[-1] == 0:
        return None
    return dispatch.shape_class(v.dtype, *k.shape[1:], v.shape[-1])


@chunk_kda.register_fake
def _chunk_kda_fake(q, k, v, g, beta, scale=None, initial_state=None, *, output_final_state=False,
                    chunk_size=64):
    _validate(q, k, v, g, beta, initial_state, chunk_size)
    b, t_len, h, dk = k.shape
    o = v.new_empty(b, t_len, h, v.shape[-1])
    final = k.new_empty(b, h, dk, v.shape[-1], dtype=torch.float32) if output_final_state \
        else k.new_empty(0, dtype=torch.float32)
    return o, final


@torch.library.custom_op("ascend_dsa::chunk_kda_states", mutates_args=())
def chunk_kda_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float | None = None, initial_state: torch.Tensor | None = None, *, num_states: int,
                     chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chunk_kda's (o, final_state) and the state after each of the first `num_states` steps `[B, n, H, K, V]`
    fp32, from one pass over the tokens (module docstring). Inference only: it has no gradient."""
    _validate_states(q, k, v, g, beta, initial_state, chunk_size, num_states)
    b, _, h, dk = k.shape

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        states = torch.empty(b, num_states, h, dk, v.shape[-1], dtype=torch.float32)
        o, final = _chunk_kda_cpu(q, k, v, g, beta, scale, initial_state, True, chunk_size, states)
        return o, final, states

    cls = native_class(q, k, v, g, beta)
    return run() if cls is None else dispatch.run(OP, chunk_kda_native.NATIVE_SOURCE, cls, run,
                                                  dispatch.torch_path(run))


def _validate_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial_state: torch.Tensor | None, chunk_size: int, num_states: int) -> None:
    _validate(q, k, v, g, beta, initial_state, chunk_size)
    require(0 <= num_states <= k.shape[1], f"chunk_kda_states: `num_states` counts checkpoints of the first steps "
                                           f"and must be in [0, T={k.shape[1]}]; got {num_states}")


@chunk_kda_states.register_fake
def _chunk_kda_states_fake(q, k, v, g, beta, scale=None, initial_state=None, *, num_states, chunk_size=64):
    _validate_states(q, k, v, g, beta, initial_state, chunk_size, num_states)
    b, t_len, h, dk = k.shape
    dv = v.shape[-1]
    return (v.new_empty(b, t_len, h, dv), k.new_empty(b, h, dk, dv, dtype=torch.float32),
            k.new_empty(b, num_states, h, dk, dv, dtype=torch.float32))


def kda_transition(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                   chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine state map of a segment: returns (A [B,H,K,K] fp32, S_zero [B,H,K,V] fp32) such that
    running the segment from any initial state S0 [B,H,K,V] ends in A @ S0 + S_zero; S_zero is the
    final state from a zero initial state. A is the ordered product of the per-step maps
    (I - beta_t k_t k_t^T) Diag(exp g_t), last step leftmost. Segments fold left to right:
    S_after = A_r @ S_before + S_zero_r.
    """
    _validate(None, k, v, g, beta, None, chunk_size)
    b, _, h, dk = k.shape
    kc, vc, gc, bc = (_to_chunks(x, chunk_size) for x in (k, v, g, beta))
    intra = _intra(kc, vc, gc, bc, None)
    s_zero, _, _ = _scan(intra, kc.new_zeros(b * h, dk, v.shape[-1]))
    per_chunk = torch.diag_embed(intra.decay.squeeze(-1)) - torch.matmul(intra.k_tail, intra.w_k)  # [N,BH,K,K]
    a = torch.eye(dk, dtype=torch.float32).expand(b * h, dk, dk)
    for step in per_chunk:
        a = torch.bmm(step, a)
    return a.reshape(b, h, dk, dk).contiguous(), s_zero.view(b, h, dk, v.shape[-1])

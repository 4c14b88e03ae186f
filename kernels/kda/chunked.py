"""The chunked form of `ascend_dsa::chunk_kda` in torch (kernels/kda/chunk_kda.py runs it when the native
recurrence is not built and the sequence is long and finite), and `kda_transition`, the affine state map of a
segment built on it.

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
"""
from typing import NamedTuple

import torch

from npu_graph.kernels.kda.checks import FLOOR_EXPONENT, validate

# Largest |exponent| allowed in one factor of a split decay: e**60 and e**-60 are normal fp32 numbers.
_SAFE_EXPONENT = 60.0


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
    """exp of a log-decay <= 0, floored at exp(FLOOR_EXPONENT) (no change at fp32 precision)."""
    return log_decay.clamp(min=FLOOR_EXPONENT).exp_()


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


def fitted_chunk(chunk_size: int, t_len: int) -> int:
    """chunk_size (a power of two), but no larger than the power of two that holds the sequence: a larger chunk
    gives the same results and would only pad the chunks with zeros (2**40 would ask for terabytes)."""
    return min(chunk_size, 1 << max(t_len - 1, 0).bit_length())


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
             state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form (module docstring): o [B,T,H,V] fp32 and the final state [B*H, K, V]."""
    b, t_len, h, _ = k.shape
    dv = v.shape[-1]
    chunk_size = fitted_chunk(chunk_size, t_len)
    qc = _to_chunks(q, chunk_size).mul_(scale)
    kc, vc, gc, bc = (_to_chunks(x, chunk_size) for x in (k, v, g, beta))
    intra = _intra(kc, vc, gc, bc, qc)
    final, entering, us = _scan(intra, state)
    n, c = kc.shape[0], chunk_size
    o = torch.matmul(intra.q_decay, entering).view(n * b * h, c, dv)
    o = torch.baddbmm(o, intra.m_qk.view(-1, c, c), us.view(-1, c, dv))
    return o.view(n, b, h, c, dv).permute(1, 0, 3, 2, 4).reshape(b, n * c, h, dv)[:, :t_len], final


def kda_transition(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                   chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine state map of a segment: returns (A [B,H,K,K] fp32, S_zero [B,H,K,V] fp32) such that
    running the segment from any initial state S0 [B,H,K,V] ends in A @ S0 + S_zero; S_zero is the
    final state from a zero initial state. A is the ordered product of the per-step maps
    (I - beta_t k_t k_t^T) Diag(exp g_t), last step leftmost. Segments fold left to right:
    S_after = A_r @ S_before + S_zero_r.
    """
    validate(None, k, v, g, beta, None, chunk_size)
    b, _, h, dk = k.shape
    chunk_size = fitted_chunk(chunk_size, k.shape[1])
    kc, vc, gc, bc = (_to_chunks(x, chunk_size) for x in (k, v, g, beta))
    intra = _intra(kc, vc, gc, bc, None)
    s_zero, _, _ = _scan(intra, kc.new_zeros(b * h, dk, v.shape[-1]))
    per_chunk = torch.diag_embed(intra.decay.squeeze(-1)) - torch.matmul(intra.k_tail, intra.w_k)  # [N,BH,K,K]
    a = torch.eye(dk, dtype=torch.float32).expand(b * h, dk, dk)
    for step in per_chunk:
        a = torch.bmm(step, a)
    return a.reshape(b, h, dk, dk).contiguous(), s_zero.view(b, h, dk, v.shape[-1])

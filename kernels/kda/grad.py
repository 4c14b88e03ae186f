"""Gradients of `ascend_dsa::chunk_kda`, so a model that calls the fused op can be trained.

The forward stays the fast op (native recurrence or its torch path, which write into preallocated buffers and
cannot be differentiated). The backward recomputes the outputs with `differentiable_chunk_kda`, a chunked form
written only in out-of-place torch ops, and lets autograd differentiate it: one extra forward pass per backward,
as activation checkpointing does.

The chunked form, per chunk of C steps with state S entering it and Γ_t the cumulative log decay inside the
chunk (per channel): with E[t, i] = exp(Γ_t − Γ_i) for i ≤ t (formed pairwise from differences, never as
exp(Γ_t)·exp(−Γ_i), which overflows for strong decay),

    A[t, i] = β_t Σ_c k_t E[t, i] k_i   (i < t)        δ = (I + A)⁻¹ β ⊙ (v − (k ⊙ e^Γ) S)
    o_t     = scale · ((q_t ⊙ e^Γ_t) S + Σ_{i ≤ t} (Σ_c q_t E[t, i] k_i) δ_i)
    S'      = e^Γ_C ⊙ S + Σ_i (k_i ⊙ exp(Γ_C − Γ_i)) δ_iᵀ

which is the step recurrence S_t = (I − β_t k_t k_tᵀ) Diag(e^g_t) S_{t−1} + β_t k_t v_tᵀ unrolled over the chunk.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

GRAD_CHUNK = 16     # the pairwise decay tensor is C x C x K per chunk and head


def _pairwise_decay(gamma: torch.Tensor) -> torch.Tensor:
    """exp(Γ_t − Γ_i) for i ≤ t, else 0: [..., C (t), C (i), K]."""
    c = gamma.shape[-2]
    later = torch.ones(c, c, dtype=torch.bool, device=gamma.device).triu(1).unsqueeze(-1)
    return (gamma.unsqueeze(-2) - gamma.unsqueeze(-3)).masked_fill(later, float("-inf")).exp()


def _pairwise(x: torch.Tensor, decay: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Σ_c x_t[c] decay[t, i, c] y_i[c]: [..., C, C] (elementwise: as a batched GEMM over t it is slower)."""
    return (x.unsqueeze(-2) * decay * y.unsqueeze(-3)).sum(-1)


def _unit_lower_solve(lower: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """(I + lower)⁻¹ rhs for a strictly lower triangular `lower` [..., C, C] (C a power of two): with M = −lower
    nilpotent, (I − M)⁻¹ = (I + M)(I + M²)(I + M⁴)…, log2(C) batched products instead of a triangular solve,
    which is slow for many small batched systems on CPU."""
    power, out = -lower, rhs
    for _ in range(lower.shape[-1].bit_length() - 1):
        out = out + power @ out
        power = power @ power
    return out


def _chunk_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                scale: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk (module docstring): q, k, gamma [B, H, C, K], v [B, H, C, V], beta [B, H, C], state
    [B, H, K, V] -> (o [B, H, C, V], state after the chunk)."""
    decay = _pairwise_decay(gamma)
    lower = _pairwise(k, decay, k).tril(-1) * beta.unsqueeze(-1)
    rhs = beta.unsqueeze(-1) * (v - (k * gamma.exp()) @ state)
    delta = _unit_lower_solve(lower, rhs)
    o = scale * ((q * gamma.exp()) @ state + _pairwise(q, decay, k) @ delta)
    last = gamma[..., -1:, :]
    state = last.transpose(-1, -2).exp() * state + (k * (last - gamma).exp()).transpose(-1, -2) @ delta
    return o, state


def differentiable_chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, scale: float, initial_state: torch.Tensor | None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_kda's outputs (o [B, T, H, V] fp32, final state [B, H, K, V]) from out-of-place ops only."""
    b, t_len, h, dk = k.shape
    pad = (-t_len) % GRAD_CHUNK

    def heads_first(x: torch.Tensor) -> torch.Tensor:       # [B, T, H, *] -> [B, H, T (padded), *]
        x = x.float().movedim(1, 2)
        return F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))

    q, k, v, g, beta = (heads_first(x) for x in (q, k, v, g, beta))
    state = (initial_state.float() if initial_state is not None
             else q.new_zeros(b, h, dk, v.shape[-1]))
    outs = []
    for start in range(0, t_len + pad, GRAD_CHUNK):
        part = slice(start, start + GRAD_CHUNK)
        gamma = g[:, :, part].cumsum(dim=-2)
        o, state = _chunk_step(q[:, :, part], k[:, :, part], v[:, :, part], gamma, beta[:, :, part], scale,
                               state)
        outs.append(o)
    o = torch.cat(outs, dim=2)[:, :, :t_len].movedim(2, 1)
    return o, state


def _setup_context(ctx: Any, inputs: tuple, output: tuple, keyword_only_inputs: dict | None = None) -> None:
    q, k, v, g, beta, scale, initial_state = inputs
    ctx.scale = k.shape[-1] ** -0.5 if scale is None else scale
    ctx.has_state = initial_state is not None
    ctx.save_for_backward(q, k, v, g, beta, *([initial_state] if ctx.has_state else []))


def _backward(ctx: Any, grad_o: torch.Tensor, grad_state: torch.Tensor) -> tuple:
    saved = ctx.saved_tensors
    leaves = [t.detach().requires_grad_() for t in saved]
    q, k, v, g, beta = leaves[:5]
    initial_state = leaves[5] if ctx.has_state else None
    with torch.enable_grad():
        o, final = differentiable_chunk_kda(q, k, v, g.clamp(min=-80.0), beta, ctx.scale, initial_state)
        outputs, grads = [o.to(v.dtype)], [grad_o]
        if grad_state is not None and grad_state.numel():
            outputs.append(final)
            grads.append(grad_state)
        found = torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
    found = [torch.zeros_like(t) if d is None else d for t, d in zip(leaves, found)]
    return (*found[:5], None, found[5] if ctx.has_state else None)


def register(op: Any) -> None:
    """Attach the backward above to the custom op `ascend_dsa::chunk_kda` (its keyword-only arguments,
    output_final_state and chunk_size, get no gradient)."""
    op.register_autograd(_backward, setup_context=_setup_context)

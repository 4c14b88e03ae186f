"""KDA (`chunk_kda`) over a sequence split into contiguous slices, one per CP rank.

Math. Per head, step t maps the state S [K,V] affinely: S_t = M_t S_{t−1} + β_t k_t v_tᵀ with
M_t = (I − β_t k_t k_tᵀ) Diag(exp g_t). Over a rank's slice of steps 1..T, from an initial state S0:

    S_t = P_t S0 + Z_t,     P_t = M_t ··· M_1 [K,K],   Z_t = the state reached from S0 = 0
    o_t = scale · S_tᵀ q_t = o⁰_t + (scale · P_tᵀ q_t)ᵀ S0 = o⁰_t + q̃_tᵀ S0

so the output given the true initial state is the zero-state output o⁰ plus Q̃ S0, with the effective
queries q̃_t = scale · P_tᵀ q_t, exactly (linear in S0; no rerun). The slice's transition is
(A, Z) = (P_T, Z_T): S_T = A S0 + Z.

One fused call computes all four. Run `chunk_kda` with the value columns extended to [v | 0_K] and the
initial state [0_V | I_K]: the recurrence acts column by column, so the first V columns are the zero-state
run (o⁰, Z) and the last K columns, whose values are zero, carry P_t I: their outputs are scale · (P_t I)ᵀ
q_t = q̃_t and their final state is P_T = A.

Exchange and fold. Each rank packs [Z | A] ([B,H,K,V+K] fp32) and one all-gather over the CP group gives
every rank every slice's transition. Folding left to right from the sequence's initial state S_in(0),
S_in(r+1) = A_r S_in(r) + Z_r gives rank r its true initial state; it corrects its outputs with
o = o⁰ + Q̃ S_in(r). Folding all ranks gives the sequence's final state, on every rank.

Long prompts (`kda_split_blocks`). The correction keeps o⁰ and Q̃ of the whole slice in fp32, (V + K) columns
per step: at 128K tokens and 32 heads of 128 that is as much as the whole sequence's bf16 inputs. For a prompt
held as time blocks, the slice's transition is computed block by block from [0 | I], keeping only the running
[Z | A] (no outputs), and after the fold the slice is run again from its true initial state, block by block,
giving its outputs directly: a rank holds its slice's inputs and outputs and a few blocks of temporaries, at
(2V + K) / V of the slice's one-pass work.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from npu_graph.parallel.cp_gather import gather_parts
from npu_graph.parallel.groups import group_size_rank


class SliceRun(NamedTuple):
    """A slice run from a zero state, with what the exact correction and the fold need (fp32)."""

    o_zero: torch.Tensor        # outputs from a zero initial state      [B,T,H,V]
    q_eff: torch.Tensor         # effective queries scale · P_tᵀ q_t     [B,T,H,K]
    transition: torch.Tensor    # [Z | A]: state map S -> A S + Z        [B,H,K,V+K]


def run_slice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
              scale: float | None = None, chunk_size: int = 64) -> SliceRun:
    """One fused `chunk_kda` call on the slice with values [v | 0] and initial state [0 | I] (see above)."""
    batch, seq, heads, dim_k = k.shape
    dim_v = v.shape[-1]
    values = torch.cat((v.float(), v.new_zeros(batch, seq, heads, dim_k, dtype=torch.float32)), dim=-1)
    identity = torch.eye(dim_k, dtype=torch.float32, device=k.device).expand(batch, heads, dim_k, dim_k)
    state = torch.cat((torch.zeros(batch, heads, dim_k, dim_v, dtype=torch.float32, device=k.device), identity), dim=-1)
    o, final = torch.ops.ascend_dsa.chunk_kda(q, k, values, g, beta, scale, state, output_final_state=True,
                                              chunk_size=chunk_size)
    o_zero, q_eff = o.split([dim_v, dim_k], dim=-1)
    return SliceRun(o_zero, q_eff, final)


def fold_states(transitions: list[torch.Tensor], initial_state: torch.Tensor) -> list[torch.Tensor]:
    """States entering each slice and, last, the state after all of them: [S_in(0), ..., S_in(n)]."""
    dim_v = initial_state.shape[-1]
    states = [initial_state]
    for transition in transitions:
        zero_run, a = transition.split([dim_v, transition.shape[-1] - dim_v], dim=-1)
        states.append(torch.matmul(a, states[-1]) + zero_run)
    return states


def correct_outputs(run: SliceRun, state: torch.Tensor) -> torch.Tensor:
    """The slice's outputs [B,T,H,V] (fp32) given its true initial state [B,H,K,V]: o⁰ + Q̃ S."""
    return run.o_zero + torch.einsum("bthk,bhkv->bthv", run.q_eff, state)


def kda_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              group: dist.ProcessGroup | None, *, scale: float | None = None,
              initial_state: torch.Tensor | None = None,
              chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_kda` of a whole sequence from this rank's contiguous slice (rank r of the CP group holds the
    r-th slice; slices may differ in length, e.g. `x.tensor_split(cp, dim=1)[r]`).

    `initial_state` [B,H,K,V] is the state before the whole sequence (zeros when None), the same on every
    rank. Returns (this slice's outputs [B,T_r,H,V] in v's dtype, the sequence's final state fp32).
    """
    batch, _, heads, dim_k = k.shape
    dim_v = v.shape[-1]
    start = torch.zeros(batch, heads, dim_k, dim_v, dtype=torch.float32, device=k.device) if initial_state is None \
        else initial_state.float()
    if tuple(start.shape) != (batch, heads, dim_k, dim_v):
        raise ValueError(f"kda_split: initial_state has shape {tuple(start.shape)}, expected [B,H,K,V] = "
                         f"{[batch, heads, dim_k, dim_v]}")
    _, rank = group_size_rank(group)
    run = run_slice(q, k, v, g, beta, scale=scale, chunk_size=chunk_size)
    states = fold_states(gather_parts(run.transition, group), start)
    return correct_outputs(run, states[rank]).to(v.dtype), states[-1]


Block = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]     # q, k, v, g, beta


def slice_transition(blocks: Sequence[Block], *, scale: float | None = None, chunk_size: int = 64) -> torch.Tensor:
    """[Z | A] `[B,H,K,V+K]` fp32 of a slice given as consecutive time blocks, one `chunk_kda` call per block
    with values [v | 0] from the running state (module docstring); no block's outputs are kept."""
    _, k, v, _, _ = blocks[0]
    batch, _, heads, dim_k = k.shape
    dim_v = v.shape[-1]
    identity = torch.eye(dim_k, dtype=torch.float32).expand(batch, heads, dim_k, dim_k)
    state = torch.cat((torch.zeros(batch, heads, dim_k, dim_v, dtype=torch.float32), identity), dim=-1)
    for q, k, v, g, beta in blocks:
        values = torch.cat((v, v.new_zeros(*v.shape[:-1], dim_k)), dim=-1)
        _, state = torch.ops.ascend_dsa.chunk_kda(q, k, values, g, beta, scale, state, output_final_state=True,
                                                  chunk_size=chunk_size)
    return state


def kda_split_blocks(blocks: Sequence[Block], group: dist.ProcessGroup | None,
                     emit: Callable[[int, torch.Tensor], None], *, scale: float | None = None,
                     chunk_size: int = 64, clock: dict[str, float] | None = None) -> torch.Tensor:
    """`kda_split` of this rank's contiguous slice held as time blocks, in two passes (module docstring): the
    slice's transition, one all-gather and the fold, then each block run from its true state; `emit(i, o)`
    receives block i's outputs `[B,T_i,H,V]` (v's dtype) as they are made. The initial state of the sequence
    is zero. Returns the sequence's final state `[B,H,K,V]` fp32. `clock`, when given, receives the seconds of
    each part: "transition", "exchange" (the all-gather and the fold) and "outputs"."""
    _, rank = group_size_rank(group)
    marks = [time.perf_counter()]
    transition = slice_transition(blocks, scale=scale, chunk_size=chunk_size)
    marks.append(time.perf_counter())
    batch, heads, dim_k, width = transition.shape
    states = fold_states(gather_parts(transition, group),
                         torch.zeros(batch, heads, dim_k, width - dim_k, dtype=torch.float32))
    marks.append(time.perf_counter())
    state = states[rank]
    for index, (q, k, v, g, beta) in enumerate(blocks):
        o, state = torch.ops.ascend_dsa.chunk_kda(q, k, v, g, beta, scale, state, output_final_state=True,
                                                  chunk_size=chunk_size)
        emit(index, o)
    marks.append(time.perf_counter())
    if clock is not None:
        clock.update(zip(("transition", "exchange", "outputs"), (b - a for a, b in itertools.pairwise(marks))))
    return states[-1]

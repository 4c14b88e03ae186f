"""Argument checks of `ascend_dsa::chunk_kda` and `ascend_dsa::chunk_kda_states` (kernels/kda/chunk_kda.py): ranks,
shapes, dtypes and options (nothing that reads tensor data, so the fakes run them too), and the one check on the
data, that the log decay g is <= 0."""
import math

import torch

from npu_graph.kernels.checks import (
    once_per_signature,
    require,
    require_dtype,
    require_positive,
    require_rank,
    require_same,
)

OP = "chunk_kda"
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Decays below e**-80 (< 2e-35) are held there: exp() of underflowing inputs is several times slower.
FLOOR_EXPONENT = -80.0


@once_per_signature
def validate(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
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


def validate_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial_state: torch.Tensor | None, chunk_size: int, num_states: int) -> None:
    validate(q, k, v, g, beta, initial_state, chunk_size)
    require(0 <= num_states <= k.shape[1], f"chunk_kda_states: `num_states` counts checkpoints of the first steps "
                                           f"and must be in [0, T={k.shape[1]}]; got {num_states}")


def check_scale(scale: float | None) -> None:
    """`scale` multiplies q: a NaN or infinite one would make every output non-finite, as NaN or ±inf depending on
    where the paths apply it."""
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"{OP}: `scale` must be a finite number (got {scale}); None takes the default K ** -0.5")


def checked_log_decay(g: torch.Tensor) -> torch.Tensor:
    """g in fp32, floored at FLOOR_EXPONENT (so -inf, a full reset, is e**-80: zero at fp32 precision in every
    path); a positive log decay (a state that grows) is refused."""
    g = g.float()
    if bool((g > 0).any()):
        where = [int(i) for i in (g > 0).nonzero()[0]]
        raise ValueError(f"{OP}: `g` is a log decay and must be <= 0 (or -inf); g{where} = {float(g[tuple(where)])}")
    return g.clamp(min=FLOOR_EXPONENT)

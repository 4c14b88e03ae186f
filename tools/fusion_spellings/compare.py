"""How a family decides that compiled output equals eager output: tensors within a relative error (the largest
difference over the largest magnitude, 1e-5 in fp32), top-k picks by the scores they select (ties at the cut may
pick either key), routing by the (expert, weight) pairs of every token."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

RTOL = 1e-5


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.shape != ref.shape:
        raise ValueError(f"shape {tuple(out.shape)} where eager gives {tuple(ref.shape)}")
    if ref.numel() == 0:
        return 0.0
    out, ref = out.double(), ref.double()
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(out)) or not torch.equal(out[~finite], ref[~finite]):
        return float("inf")
    scale = ref[finite].abs().max().item() if finite.any() else 0.0
    diff = (out[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
    return diff / scale if scale else diff


def close(rtol: float = RTOL) -> Callable[[Any, Any, tuple], str | None]:
    """Every tensor of the output within `rtol` of eager's (same dtype and shape)."""
    def check(out: Any, ref: Any, inputs: tuple) -> str | None:
        outs, refs = _flat(out), _flat(ref)
        if len(outs) != len(refs):
            return f"{len(outs)} outputs where eager gives {len(refs)}"
        for i, (o, r) in enumerate(zip(outs, refs)):
            if o.dtype != r.dtype:
                return f"output {i} is {o.dtype} where eager gives {r.dtype}"
            try:
                error = relative_error(o, r)
            except ValueError as exc:
                return f"output {i}: {exc}"
            if error > rtol:
                return f"output {i} differs from eager by {error:.2e} (relative)"
        return None

    return check


def _flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _flat(v)]


def picked_scores(scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The scores each row's picks select, sorted (masked picks read -inf)."""
    flat_scores = scores.reshape(-1, scores.shape[-1])
    flat = indices.reshape(flat_scores.shape[0], -1).long().clamp(0, scores.shape[-1] - 1)
    return flat_scores.gather(1, flat).sort(dim=1, descending=True).values


def same_picks(score_fn: Callable[..., torch.Tensor], rtol: float = RTOL) -> Callable[[Any, Any, tuple], str | None]:
    """Top-k indices (the first output) select scores equal to eager's picks row by row (a tie at the cut may
    pick either key); further outputs (top-k values) within `rtol`."""
    def check(out: Any, ref: Any, inputs: tuple) -> str | None:
        outs, refs = _flat(out), _flat(ref)
        if outs[0].shape != refs[0].shape or outs[0].dtype != refs[0].dtype:
            return f"indices {outs[0].dtype}{tuple(outs[0].shape)} where eager gives {refs[0].dtype}" \
                   f"{tuple(refs[0].shape)}"
        scores = score_fn(*inputs)
        error = relative_error(picked_scores(scores, outs[0]), picked_scores(scores, refs[0]))
        if error > rtol:
            return f"the picks select other scores than eager's ({error:.2e} relative)"
        return close(rtol)(outs[1:], refs[1:], inputs)

    return check


def same_routing(rtol: float = RTOL) -> Callable[[Any, Any, tuple], str | None]:
    """(weights [T, k], ids [T, k]) outputs: every token routes to the same experts with the same weights, in any
    order of its k slots."""
    def check(out: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], inputs: tuple) -> str | None:
        (w, ids), (w_ref, ids_ref) = out, ref
        if ids.dtype != ids_ref.dtype or w.dtype != w_ref.dtype:
            return f"dtypes {w.dtype}/{ids.dtype} where eager gives {w_ref.dtype}/{ids_ref.dtype}"
        order, order_ref = ids.sort(dim=-1), ids_ref.sort(dim=-1)
        if not torch.equal(order.values, order_ref.values):
            return "tokens route to other experts than eager's"
        error = relative_error(w.gather(-1, order.indices), w_ref.gather(-1, order_ref.indices))
        return None if error <= rtol else f"routing weights differ from eager by {error:.2e} (relative)"

    return check

"""verify=True: run the eager graph beside the compiled one on every call and report the max error per
output (a warning, or an error under strict)."""
from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

log = logging.getLogger("npu_graph")


class VerificationError(AssertionError):
    """Compiled and eager outputs differ by more than the configured tolerance (strict mode)."""


def output_errors(expected: Any, got: Any) -> list[float]:
    """Max |got − expected| per tensor output (inf on shape/dtype mismatch or NaN disagreement)."""
    flat_e, _ = tree_flatten(expected)
    flat_g, _ = tree_flatten(got)
    errors = []
    for e, g in zip(flat_e, flat_g):
        if not isinstance(e, torch.Tensor):
            continue
        if not isinstance(g, torch.Tensor) or g.shape != e.shape:
            errors.append(float("inf"))
            continue
        e64, g64 = e.detach().double(), g.detach().double()
        nan_mismatch = (e64.isnan() != g64.isnan()).any().item()
        diff = (e64 - g64).abs().nan_to_num(nan=0.0)
        errors.append(float("inf") if nan_mismatch else (diff.max().item() if diff.numel() else 0.0))
    return errors


def _tolerance(expected: torch.Tensor, atol: float, rtol: float) -> float:
    finite = expected.detach().double().nan_to_num(0.0, 0.0, 0.0)
    return atol + rtol * (finite.abs().max().item() if finite.numel() else 0.0)


def verified(name: str, eager: Callable[..., Any], compiled: Callable[..., Any], atol: float, rtol: float,
             strict: bool) -> Callable[..., Any]:
    """A callable that runs eager (on cloned inputs, so in-place updates happen once) and compiled."""

    def run(*args: Any) -> Any:
        eager_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        expected = eager(*eager_args)
        got = compiled(*args)
        flat_e = [t for t in tree_flatten(expected)[0] if isinstance(t, torch.Tensor)]
        for i, (err, e) in enumerate(zip(output_errors(expected, got), flat_e)):
            tol = _tolerance(e, atol, rtol)
            log.info("ascend_dsa verify %s output %d: max |compiled - eager| = %.3e", name, i, err)
            if err > tol:
                message = (f"ascend_dsa verify: graph {name} output {i} differs from eager by {err:.3e} "
                           f"(tolerance {tol:.3e})")
                if strict:
                    raise VerificationError(message)
                warnings.warn(message, stacklevel=2)
        return got

    run.verify_name = name
    return run

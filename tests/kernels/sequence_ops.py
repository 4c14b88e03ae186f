"""The fused ops as the call-sequence fuzzer (tests/kernels/call_sequences.py) calls them: for each op, a `Family`
of operands whose shapes stay fixed for a run (so that calls repeat signatures and meet the plans, dispatch
choices and checks cached for them), buffers that persist between calls and that the machine mutates in place,
and `draw_call`, which draws one call's variant of the operands — aliasing (value is key, a view of the same
buffer, an expanded or strided view), fresh or reused data — and returns the call, its readable reference and
how to compare the two."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st
from test_lightning_indexer import assert_same_topk

OPS = torch.ops.ascend_dsa


@dataclass
class Call:
    """One drawn call: `run` calls the op, `reference` its readable definition; `compare(got, want)` raises
    AssertionError when they differ beyond the op's tolerance."""
    op: str
    run: Callable[[], Any]
    reference: Callable[[], Any]
    compare: Callable[[Any, Any], None]
    what: dict[str, Any] = field(default_factory=dict)


def close(tol: float) -> Callable[[Any, Any], None]:
    """Outputs equal in shape and dtype, floats within tol relative to the largest reference value."""
    def compare(got: Any, want: Any) -> None:
        got, want = (x if isinstance(x, (tuple, list)) else (x,) for x in (got, want))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
            if g.dtype.is_floating_point:
                scale = 1.0 + (w.float().nan_to_num(0, 0, 0).abs().max().item() if w.numel() else 0.0)
                torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol * scale, equal_nan=True)
            else:
                assert torch.equal(g, w), (g, w)
    return compare


def topk_close(got: Any, want: Any) -> None:
    assert_same_topk(got, want, rtol=1e-4, atol=1e-3)


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def variant(data: st.DataObject, x: torch.Tensor, label: str) -> torch.Tensor:
    """x itself, a view of the same memory that is not x, a copy, or the same values in a strided view."""
    kind = data.draw(st.sampled_from(["same", "same", "view", "copy", "strided"]), label=label)
    if kind == "view":
        return x.view(x.shape)
    if kind == "copy":
        return x.clone()
    if kind == "strided":
        wide = torch.empty(*x.shape[:-1], x.shape[-1] * 2, dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    return x


class Family:
    """Operands of one op whose shapes stay fixed for a run; `buffers` persist between calls."""

    op = ""

    def __init__(self, data: st.DataObject, gen: torch.Generator):
        self.gen = gen
        self.buffers: dict[str, torch.Tensor] = {}

    def mutate(self, data: st.DataObject) -> None:
        """New values in place in one persistent buffer (a plan must not keep a buffer's data)."""
        if not self.buffers:
            return
        name = data.draw(st.sampled_from(sorted(self.buffers)), label=f"{self.op} buffer")
        buf = self.buffers[name]
        if buf.dtype.is_floating_point:
            buf.copy_(torch.randn(buf.shape, generator=self.gen).to(buf.dtype))
        else:
            self.remap(name, buf)

    def remap(self, name: str, buf: torch.Tensor) -> None:
        """New values in place in an integer buffer (families that have one say how)."""

    def draw_call(self, data: st.DataObject) -> Call:
        raise NotImplementedError

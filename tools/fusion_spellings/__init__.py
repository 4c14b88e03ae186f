"""Spellings of the fusion families: for every fused operator family, independent choices of how research code
writes the same math (einsum or matmul, relu or clamp_min, mask as masked_fill or an additive tensor, ...) and a
builder that composes one small fp32 module from a choice of each. Tests draw choices with hypothesis, `ascend-dsa
bench fusion` with a seeded sampler; both compile each spelling (fusion_check.py) and expect the family's fused op
and eager's numbers. `negatives` are spellings of other math, which must not fuse.
"""
from __future__ import annotations

import importlib
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

FAMILY_MODULES = ("indexer", "sparse_attention", "mla", "rotary", "moe_routing", "moe_experts",
                  "rms_norm", "kda", "attn_res")


@dataclass
class Spelling:
    """One composed spelling: `module(*inputs)` is the model code, `fused` the fused-op counts it must compile to,
    `check(out, ref, inputs)` None when compiled `out` equals eager `ref` within the family's rule, else the
    difference."""

    family: str
    choice: dict[str, str]
    module: Callable[..., Any]
    inputs: tuple[torch.Tensor, ...]
    fused: dict[str, int]
    check: Callable[[Any, Any, tuple], str | None]

    @property
    def name(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.choice.items())


@dataclass(frozen=True)
class Negative:
    """A spelling of different math that must not fuse: `build()` -> Spelling (its `fused` lists the op that
    must be absent, count 0) and `reason`, words the near miss must contain."""

    name: str
    build: Callable[[], Spelling]
    reason: str


@dataclass(frozen=True)
class Family:
    name: str
    choices: dict[str, tuple[str, ...]]
    build: Callable[[dict[str, str]], Spelling]
    negatives: tuple[Negative, ...] = field(default=())
    settle: Callable[[dict[str, str]], dict[str, str]] = field(default=dict)

    def spellings(self) -> list[dict[str, str]]:
        """Every distinct spelling the choices compose (`settle` maps choices a spelling does not read to one
        value, so that two draws differing only there count once)."""
        names = list(self.choices)
        found = {tuple(self.settle(dict(zip(names, combo))).items())
                 for combo in itertools.product(*self.choices.values())}
        return [dict(items) for items in sorted(found)]

    def draw(self, count: int, seed: int = 0) -> list[dict[str, str]]:
        """`count` distinct spellings (all of them when there are fewer), sampled with `seed`."""
        every = self.spellings()
        return every if len(every) <= count else random.Random(seed).sample(every, count)


def families() -> list[Family]:
    """Every family, in a fixed order."""
    return [importlib.import_module(f"{__name__}.{m}").FAMILY for m in FAMILY_MODULES]


def family(name: str) -> Family:
    found = [f for f in families() if f.name == name]
    if not found:
        raise KeyError(f"no fusion family {name!r}; families: {[f.name for f in families()]}")
    return found[0]

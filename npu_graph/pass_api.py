"""What every graph pass receives and returns: PassContext in, PassResult out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PassResult:
    """What a pass did: whether the graph changed, and counts worth showing (matches, removals...).

    `summary` holds top-level sections of the graph's summary.json that this pass owns (e.g. `quantized`,
    `layouts`, `streams`, `superkernels`); they are merged into the report after the pipeline ran."""

    changed: bool
    stats: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass
class PassContext:
    """What a pass may read: the config, the target, whether the graph is inference-only, the dump, and which
    graph inputs are model parameters (`param_indices`, placeholder positions; their work is hoisted)."""

    config: Any
    target: str = "cpu"
    inference: bool = True
    fake_mode: Any = None
    dump: Any = None
    graph_name: str = "graph"
    param_indices: tuple[int, ...] = ()

"""Emitting nodes with their fake values: a rule that replaces a node builds its replacement with `Emitter`,
whose nodes get node.meta["val"] at once (the target run on its arguments' fake values), so that rules later in
the same sweep read correct values."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx


class Emitter:
    """Creates nodes before `anchor`; `created` lists them (a rule that gives up erases them with `discard`)."""

    def __init__(self, anchor: torch.fx.Node) -> None:
        self.anchor = anchor
        self.created: list[torch.fx.Node] = []

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        graph = self.anchor.graph
        with graph.inserting_before(self.anchor):
            node = graph.call_function(target, tuple(args), dict(kwargs))
        fake_args, fake_kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        node.meta["val"] = target(*fake_args, **fake_kwargs)
        self.created.append(node)
        return node

    def discard(self) -> None:
        for node in reversed(self.created):
            if not node.users:
                node.graph.erase_node(node)
        self.created.clear()

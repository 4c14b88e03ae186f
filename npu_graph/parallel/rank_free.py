"""One graph for every rank: the process groups and the rank's own position in them, as Dynamo writes them into a
graph, rewritten so that ranks whose graphs differ by nothing else key, compile and load one cache entry.

Two kinds of constants differ from rank to rank without changing the code compiled around them:
- a process group's name (an operator argument named `group_name` or `group_ep`: torch's functional collectives,
  `ascend_dsa::moe_dispatch` / `moe_combine`). Rank 0's CP group {0, 2} and rank 1's {1, 3} have different names,
  the same shape. Each becomes an alias named by its shape (`ascend_dsa:<size>:<strides>`, the differences between
  its sorted global ranks), registered in this process for this process's group of that shape (torch's registry of
  group names, which the collectives and our EP ops resolve names through). A second group of the same shape in
  this process gets the next free alias (`...#2`), and a process compiles what it registered itself, so a name
  always means the group this process's graph meant.
- the rank's position in such a group (`ep_rank_id`), when it is this process's rank in that group: it becomes -1,
  which the EP ops read as "this process's rank in group_ep".
Ranks held as other constants (slice bounds of a TP split) change the code, and stay.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed.distributed_c10d import _resolve_process_group

GROUP_ARGUMENTS = ("group_name", "group_ep")
RANK_ARGUMENTS = {"ep_rank_id": "group_ep"}     # a rank argument -> the group argument it is a position in
THIS_RANK = -1
_ALIAS_PREFIX = "ascend_dsa:"


def _schema(target: Any) -> torch.FunctionSchema | None:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema
    if isinstance(target, torch._ops.OpOverloadPacket) and len(target.overloads()) == 1:
        return getattr(target, target.overloads()[0])._schema
    return None


def _group(name: Any) -> dist.ProcessGroup | None:
    if not isinstance(name, str):
        return None
    try:
        return _resolve_process_group(name)
    except (ValueError, RuntimeError, KeyError):
        return None


def _shape(group: dist.ProcessGroup) -> str:
    ranks = sorted(dist.get_process_group_ranks(group))
    strides = "-".join(str(b - a) for a, b in itertools.pairwise(ranks)) or "0"
    return f"{_ALIAS_PREFIX}{len(ranks)}:{strides}"


def alias(group: dist.ProcessGroup) -> str:
    """The name of `group` in rewritten graphs, registered in this process (module docstring)."""
    shape, count = _shape(group), 1
    while True:
        name = shape if count == 1 else f"{shape}#{count}"
        known = _group(name)
        if known is None:
            torch._C._distributed_c10d._register_process_group(name, group)
            return name
        if known is group or known.group_name == group.group_name:
            return name
        count += 1


def _rewrite(node: torch.fx.Node, schema: torch.FunctionSchema) -> int:
    names = [argument.name for argument in schema.arguments]
    args, kwargs = list(node.args), dict(node.kwargs)

    def get(name: str) -> Any:
        index = names.index(name)
        return args[index] if index < len(args) else kwargs.get(name)

    def put(name: str, value: Any) -> None:
        index = names.index(name)
        if index < len(args):
            args[index] = value
        else:
            kwargs[name] = value

    changed = 0
    for rank_name, group_name in RANK_ARGUMENTS.items():
        group = _group(get(group_name)) if rank_name in names and group_name in names else None
        if group is not None and get(rank_name) == dist.get_rank(group):
            put(rank_name, THIS_RANK)
            changed += 1
    for name in GROUP_ARGUMENTS:
        group = _group(get(name)) if name in names else None
        if group is not None and not get(name).startswith(_ALIAS_PREFIX):
            put(name, alias(group))
            changed += 1
    node.args, node.kwargs = tuple(args), kwargs
    return changed


def make_rank_free(gm: torch.fx.GraphModule) -> int:
    """Rewrite gm's process group names and this process's ranks in them (module docstring); how many arguments
    changed (0 outside a torch.distributed run)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    changed = 0
    for node in gm.graph.nodes:
        schema = _schema(node.target) if node.op == "call_function" else None
        if schema is not None and any(a.name in GROUP_ARGUMENTS for a in schema.arguments):
            changed += _rewrite(node, schema)
    if changed:
        gm.recompile()
    return changed


def rank_in(group_name: str, rank: int) -> int:
    """`rank` of a rewritten graph's argument: this process's rank in `group_name` where it is THIS_RANK."""
    return dist.get_rank(_resolve_process_group(group_name)) if rank == THIS_RANK else rank

"""`ascend_dsa::moe_dispatch` / `ascend_dsa::moe_combine`: MoE expert parallelism on `torch.distributed`.

They mirror torch_npu's MC2 pair `npu_moe_distribute_dispatch` / `npu_moe_distribute_combine` (no TP split,
no shared-expert ranks, `expert_token_nums_type=1`), implemented with `all_to_all_single` and variable split
sizes: every (token, slot) pair reaches its expert, whatever the routing skew. Experts sit on the ranks of
the EP group in contiguous blocks: rank r holds experts [r·L, (r+1)·L), L = moe_expert_num / ep_world_size.

    moe_dispatch(x [T,H], expert_ids [T,k] int, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
                 *, quant_mode=0, global_bs=0)
      -> expand_x [A,H]            the rows this rank's experts received, grouped by local expert and, within
                                   an expert, by source rank, then zero rows up to A (x's dtype; int8 when
                                   quant_mode=2)
         dynamic_scales [A] fp32   per-row scales of the int8 rows (quant_mode=2), else empty [0]
         expand_idx [T·k] int32    the flat position t·k + j of each row this rank sent, in sending order
         expert_token_nums [L] int64   rows received per local expert (their sum is the valid row count)
         ep_recv_counts [W·L] int32    rows received from source rank s for local expert e at s·L + e
    moe_combine(expand_x [A,H], expert_ids, expand_idx, ep_send_counts, expert_scales [T,k], group_ep,
                ep_world_size, ep_rank_id, moe_expert_num)
      -> out [T,H] in expand_x's dtype: out[t] = Σ_j expert_scales[t,j] · row returned for (t, j)

A is static, as on the NPU: a token's k experts are distinct, so one rank receives at most min(k, L) rows per
token of the group, A = G·min(k, L) with G = global_bs (0: every rank has T, G = W·T). As for MC2, ranks with
different token counts pass global_bs >= W · the largest count (MC2 takes max_bs·W). Graphs compiled around the
ops therefore keep static shapes and no graph break. The first all-to-all (rows per expert) also carries each
rank's token count and whether its expert ids are valid (in range, distinct per token), so unequal counts with
global_bs=0, a global_bs too small, or one rank's bad ids fail every rank of the group with the same error,
from that one collective: no rank is left waiting for a peer that gave up.
`ep_send_counts` is dispatch's `ep_recv_counts`; `expand_x` for combine holds the expert outputs in the rows
where dispatch delivered their inputs (padding rows are ignored). `group_ep` is a process group's
`group_name`; `ep_rank_id` -1 means this process's rank in it. quant_mode=2 quantizes each dispatched row to
int8 with its own scale (ep_quant.py); combine always sends the activation dtype. Every rank of the group must
call both ops, in the same order, as with any collective. Inference only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from npu_graph.kernels.checks import require, require_choice, require_dtype, require_rank, require_same
from npu_graph.parallel import ep_quant

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INDEX = (torch.int32, torch.int64)


def resolve_group(op: str, group_ep: str, ep_world_size: int, ep_rank_id: int) -> dist.ProcessGroup:
    """The process group named `group_ep`, checked against the EP size and rank the caller expects (ep_rank_id -1:
    this process's rank in it, as a graph compiled for every rank passes: npu_graph.parallel.rank_free)."""
    require(dist.is_initialized(), f"{op}: torch.distributed is not initialized; call init_process_group "
                                   f"first (or run under npu_graph.parallel.launch)")
    try:
        group = _resolve_process_group(group_ep)
    except (ValueError, RuntimeError, KeyError) as error:
        raise ValueError(f"{op}: no process group is named {group_ep!r} in this process ({error})") from error
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    ep_rank_id = rank if ep_rank_id == -1 else ep_rank_id
    require(size == ep_world_size, f"{op}: group {group_ep!r} has {size} ranks but ep_world_size="
                                   f"{ep_world_size}: the experts were split for another EP group")
    require(rank == ep_rank_id, f"{op}: this process is rank {rank} of group {group_ep!r} but ep_rank_id="
                                f"{ep_rank_id}: the model was sharded for another rank")
    return group


def _validate(op: str, x: torch.Tensor, expert_ids: torch.Tensor, ep_world_size: int,
              moe_expert_num: int) -> None:
    require_rank(op, "expert_ids", expert_ids, 2)
    require_dtype(op, "expert_ids", expert_ids, _INDEX)
    require_rank(op, "x", x, 2)
    require(ep_world_size >= 1, f"{op}: ep_world_size must be >= 1, got {ep_world_size}")
    require(moe_expert_num % ep_world_size == 0,
            f"{op}: moe_expert_num={moe_expert_num} experts cannot be split evenly over ep_world_size="
            f"{ep_world_size} ranks; choose an EP size that divides the expert count")


_OK, _OUT_OF_RANGE, _REPEATED = 0, 1, 2


def _ids_status(expert_ids: torch.Tensor, moe_expert_num: int) -> int:
    """_OK, or why this rank's expert ids cannot be dispatched (out of range; a token's k ids not distinct)."""
    if not expert_ids.numel():
        return _OK
    if int(expert_ids.min()) < 0 or int(expert_ids.max()) >= moe_expert_num:
        return _OUT_OF_RANGE
    ordered = expert_ids.sort(dim=1).values
    return _REPEATED if bool((ordered[:, 1:] == ordered[:, :-1]).any()) else _OK


def _exchange_counts(expert_ids: torch.Tensor, moe_expert_num: int, ep_world_size: int, group: dist.ProcessGroup
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int]]:
    """One all-to-all of [rows for each of the peer's experts..., token count, ids status] with every peer:
    (send order, rows sent per global expert, rows received per (source, local expert), every rank's token
    count, every rank's status). A rank with bad ids sends no rows but still takes part, so every rank learns
    of it from the same collective and fails alike: none is left waiting in the next one."""
    status = _ids_status(expert_ids, moe_expert_num)
    long = {"dtype": torch.long, "device": expert_ids.device}
    if status == _OK:
        order, counts = _send_plan(expert_ids, moe_expert_num)
    else:
        order, counts = torch.zeros(0, **long), torch.zeros(moe_expert_num, **long)
    local = moe_expert_num // ep_world_size
    tail = torch.tensor([[expert_ids.shape[0], status]], **long).expand(ep_world_size, 2)
    header = torch.cat([counts.view(ep_world_size, local), tail], dim=1).contiguous()
    received = torch.empty_like(header)
    dist.all_to_all_single(received, header, group=group)
    return (order, counts, received[:, :local].reshape(-1).contiguous(), received[:, local].tolist(),
            received[:, local + 1].tolist())


def _check_peers(op: str, tokens: list[int], statuses: list[int], global_bs: int, moe_expert_num: int) -> None:
    """The same verdict on every rank of the group, from every rank's token count and ids status."""
    for status, what in ((_OUT_OF_RANGE, f"`expert_ids` must lie in [0, {moe_expert_num})"),
                         (_REPEATED, "the k expert ids of a token must be distinct (as npu_moe_distribute_dispatch "
                                     "requires)")):
        ranks = [rank for rank, s in enumerate(statuses) if s == status]
        require(not ranks, f"{op}: {what}; EP ranks {ranks} passed ids that are not, so every rank of the group "
                           f"stops here")
    world, largest = len(tokens), max(tokens)
    require(global_bs or len(set(tokens)) == 1,
            f"{op}: the EP ranks have different token counts {tokens} and global_bs=0, which needs equal counts; "
            f"pass global_bs >= ep_world_size · the largest count = {world * largest} (MC2 takes max_bs · "
            f"ep_world_size)")
    require(not global_bs or global_bs >= world * largest,
            f"{op}: global_bs={global_bs} is below ep_world_size · the largest token count of the group = "
            f"{world}·{largest} = {world * largest}; pass at least that (MC2 takes max_bs · ep_world_size)")


def row_bound(tokens: int, top_k: int, ep_world_size: int, moe_expert_num: int, global_bs: int = 0) -> int:
    """A: the most rows one rank can receive (see the module docstring)."""
    return (global_bs or ep_world_size * tokens) * min(top_k, moe_expert_num // ep_world_size)


def _send_plan(expert_ids: torch.Tensor, moe_expert_num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat t·k + j positions sorted by expert, hence by destination rank; rows sent per global expert)."""
    flat = expert_ids.reshape(-1).long()
    return torch.sort(flat, stable=True).indices, torch.bincount(flat, minlength=moe_expert_num)


def _rank_splits(counts: torch.Tensor, ep_world_size: int) -> list[int]:
    """Per-rank row counts from per-(rank, local expert) counts."""
    return counts.view(ep_world_size, -1).sum(dim=1).tolist()


def _expert_major(recv_counts: torch.Tensor, ep_world_size: int) -> torch.Tensor:
    """Permutation that turns rows received source-major (source rank, then local expert) expert-major."""
    local = recv_counts.numel() // ep_world_size
    expert_of_row = torch.arange(local).repeat(ep_world_size).repeat_interleave(recv_counts.long())
    return torch.sort(expert_of_row, stable=True).indices


@torch.library.custom_op("ascend_dsa::moe_dispatch", mutates_args=())
def moe_dispatch(x: torch.Tensor, expert_ids: torch.Tensor, group_ep: str, ep_world_size: int, ep_rank_id: int,
                 moe_expert_num: int, *, quant_mode: int = 0, global_bs: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Send each (token, slot) row to the rank holding its expert; see the module docstring."""
    op = "moe_dispatch"
    _validate(op, x, expert_ids, ep_world_size, moe_expert_num)
    require_choice(op, "quant_mode", quant_mode, (0, 2))
    require_same(op, "token count T of `expert_ids` [T,k] and `x` [T,H]", expert_ids.shape[0], x.shape[0])
    group = resolve_group(op, group_ep, ep_world_size, ep_rank_id)
    order, counts, recv_counts, tokens, statuses = _exchange_counts(expert_ids, moe_expert_num, ep_world_size, group)
    _check_peers(op, tokens, statuses, global_bs, moe_expert_num)
    rows = x.index_select(0, order // expert_ids.shape[1])
    if quant_mode == 2:
        rows = ep_quant.pack(*ep_quant.quantize_rows(rows))
    send_splits, recv_splits = _rank_splits(counts, ep_world_size), _rank_splits(recv_counts, ep_world_size)
    bound = row_bound(x.shape[0], expert_ids.shape[1], ep_world_size, moe_expert_num, global_bs)
    received = rows.new_empty(sum(recv_splits), rows.shape[1])
    dist.all_to_all_single(received, rows.contiguous(), recv_splits, send_splits, group=group)
    received = received.index_select(0, _expert_major(recv_counts, ep_world_size))
    received = torch.cat([received, received.new_zeros(bound - received.shape[0], received.shape[1])])
    if quant_mode == 2:
        expand_x, scales = ep_quant.unpack(received)
    else:
        expand_x, scales = received, x.new_empty(0, dtype=torch.float32)
    token_nums = recv_counts.view(ep_world_size, -1).sum(dim=0)
    return expand_x, scales, order.to(torch.int32), token_nums, recv_counts.to(torch.int32)


@moe_dispatch.register_fake
def _moe_dispatch_fake(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, quant_mode=0,
                       global_bs=0):
    _validate("moe_dispatch", x, expert_ids, ep_world_size, moe_expert_num)
    rows = row_bound(x.shape[0], expert_ids.shape[1], ep_world_size, moe_expert_num, global_bs)
    dtype = torch.int8 if quant_mode == 2 else x.dtype
    return (x.new_empty(rows, x.shape[1], dtype=dtype),
            x.new_empty(rows if quant_mode == 2 else 0, dtype=torch.float32),
            x.new_empty(expert_ids.numel(), dtype=torch.int32),
            x.new_empty(moe_expert_num // ep_world_size, dtype=torch.int64),
            x.new_empty(moe_expert_num, dtype=torch.int32))


def _validate_combine(expand_x: torch.Tensor, expert_ids: torch.Tensor, expand_idx: torch.Tensor,
                      ep_send_counts: torch.Tensor, expert_scales: torch.Tensor, ep_world_size: int,
                      moe_expert_num: int) -> None:
    op = "moe_combine"
    _validate(op, expand_x, expert_ids, ep_world_size, moe_expert_num)
    require_dtype(op, "expand_x", expand_x, _FLOATS)
    require_dtype(op, "expert_scales", expert_scales, _FLOATS)
    require_same(op, "shape of `expert_scales` and `expert_ids`", tuple(expert_scales.shape),
                 tuple(expert_ids.shape))
    require_same(op, "size of `expand_idx` and T·k of `expert_ids`", expand_idx.numel(), expert_ids.numel())
    require_same(op, "size of `ep_send_counts` and moe_expert_num", ep_send_counts.numel(), moe_expert_num)


@torch.library.custom_op("ascend_dsa::moe_combine", mutates_args=())
def moe_combine(expand_x: torch.Tensor, expert_ids: torch.Tensor, expand_idx: torch.Tensor,
                ep_send_counts: torch.Tensor, expert_scales: torch.Tensor, group_ep: str, ep_world_size: int,
                ep_rank_id: int, moe_expert_num: int) -> torch.Tensor:
    """Return the expert outputs to their source ranks and sum them per token, weighted; see the docstring."""
    _validate_combine(expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, ep_world_size,
                      moe_expert_num)
    valid = int(ep_send_counts.sum())
    require(valid <= expand_x.shape[0], f"moe_combine: `ep_send_counts` totals {valid} rows but `expand_x` has "
                                        f"{expand_x.shape[0]}")
    group = resolve_group("moe_combine", group_ep, ep_world_size, ep_rank_id)
    tokens, top_k = expert_ids.shape
    source_major = torch.empty_like(expand_x[:valid]).index_copy_(
        0, _expert_major(ep_send_counts, ep_world_size), expand_x[:valid])
    counts = torch.bincount(expert_ids.reshape(-1).long(), minlength=moe_expert_num)
    returned = expand_x.new_empty(tokens * top_k, expand_x.shape[1])
    dist.all_to_all_single(returned, source_major, _rank_splits(counts, ep_world_size),
                           _rank_splits(ep_send_counts, ep_world_size), group=group)
    flat = expand_idx.long()
    weights = expert_scales.reshape(-1).float().index_select(0, flat).unsqueeze(-1)
    out = torch.zeros(tokens, expand_x.shape[1], dtype=torch.float32, device=expand_x.device)
    return out.index_add_(0, flat // top_k, returned.float() * weights).to(expand_x.dtype)


@moe_combine.register_fake
def _moe_combine_fake(expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep, ep_world_size,
                      ep_rank_id, moe_expert_num):
    _validate_combine(expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, ep_world_size,
                      moe_expert_num)
    return expand_x.new_empty(expert_ids.shape[0], expand_x.shape[1])

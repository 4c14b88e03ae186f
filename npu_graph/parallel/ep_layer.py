"""Expert-parallel MoE modules: the local experts of one rank, run as dispatch -> grouped experts -> combine.

`EPExperts` stands in for a stacked experts module (transformers' `*Experts`: `forward(hidden_states,
top_k_index, top_k_weights)`, SwiGLU weights `gate_up_proj` [E,2I,H] and `down_proj` [E,H,I]) holding only
this rank's experts (a contiguous block, or those a placement gives it: router ids are then mapped to the
placement's physical slots before dispatch), run by `ascend_dsa::grouped_swiglu`. `EPDeepSeekMoE` replaces the
reference model's `DeepSeekMoE`: the same router and shared expert (replicated), its routed experts an
`EPExperts`. Ranks that hold the same tokens (attention TP: `tp_group`) split them: each sends 1/tp of the rows
through dispatch -> experts -> combine (padded to equal parts), and an all-gather over the TP group puts the
outputs back together, so no token is dispatched twice. Under torch.compile the three steps stay ops of one
graph (`ascend_dsa::moe_dispatch`, `grouped_swiglu`, `moe_combine`; the all-gather a functional collective),
with static shapes (dispatch pads its rows to a bound): no graph break.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from npu_graph.models.moe import DeepSeekMoE
from npu_graph.parallel import ep_dispatch, ep_grouped  # noqa: F401  (register the ops used below)
from npu_graph.parallel.ep_placement import contiguous_placement, physical_slots
from npu_graph.parallel.ep_quant import dequantize_rows


class EPExperts(nn.Module):
    """This rank's experts [ep_rank·L, (ep_rank+1)·L) of `num_experts`, L = num_experts / EP size."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, num_experts: int,
                 group: dist.ProcessGroup, quant_mode: int = 0, tp_group: dist.ProcessGroup | None = None,
                 placement: Sequence[Sequence[int]] | None = None) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj, requires_grad=False)
        self.down_proj = nn.Parameter(down_proj, requires_grad=False)
        self.num_experts = num_experts
        self.group_name = group.group_name
        self.ep_world_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        self.quant_mode = quant_mode
        self.tp_group = tp_group
        contiguous = placement is None or [list(p) for p in placement] == contiguous_placement(
            num_experts, self.ep_world_size)
        self.held = None if contiguous else tuple(placement[self.ep_rank])
        self.register_buffer("slots", None if contiguous else physical_slots(placement), persistent=False)
        self.tp_size, self.tp_rank = (dist.get_world_size(tp_group), dist.get_rank(tp_group)) if tp_group else (1, 0)

    @property
    def local_experts(self) -> Sequence[int]:
        """Ids (as the router emits them) of the experts held here: a range for contiguous blocks."""
        if self.held is not None:
            return self.held
        local = self.gate_up_proj.shape[0]
        return range(self.ep_rank * local, (self.ep_rank + 1) * local)

    def extra_repr(self) -> str:
        return (f"experts {list(self.local_experts)} of {self.num_experts}, ep rank {self.ep_rank}/"
                f"{self.ep_world_size}, quant_mode={self.quant_mode}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return self._expert_parallel(hidden_states, top_k_index, top_k_weights)
        tokens, per = hidden_states.shape[0], -(-hidden_states.shape[0] // self.tp_size)
        part = slice(self.tp_rank * per, (self.tp_rank + 1) * per)
        padded = _pad_rows(per * self.tp_size, hidden_states, top_k_index, top_k_weights)
        out = self._expert_parallel(*(t[part] for t in padded))
        gathered = out.new_empty(per * self.tp_size, out.shape[1])
        dist.all_gather_single(gathered, out.contiguous(), group=self.tp_group)
        return gathered[:tokens]

    def _expert_parallel(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.ascend_dsa
        if self.slots is not None:
            top_k_index = self.slots[top_k_index]           # router ids -> physical slots of the placement
        expand_x, scales, expand_idx, token_nums, recv_counts = ops.moe_dispatch(
            hidden_states, top_k_index, self.group_name, self.ep_world_size, self.ep_rank, self.num_experts,
            quant_mode=self.quant_mode)
        if self.quant_mode == 2:
            expand_x = dequantize_rows(expand_x, scales, hidden_states.dtype)
        out = ops.grouped_swiglu(expand_x, self.gate_up_proj, self.down_proj, token_nums)
        return ops.moe_combine(out, top_k_index, expand_idx, recv_counts, top_k_weights, self.group_name,
                               self.ep_world_size, self.ep_rank, self.num_experts)


def _pad_rows(rows: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x, expert ids and weights with padding tokens appended up to `rows`: zero rows routed to experts 0..k-1
    (distinct, as dispatch requires) with zero weight, whose outputs are dropped."""
    pad = rows - x.shape[0]
    if pad == 0:
        return x, ids, weights
    spare = torch.arange(ids.shape[1], dtype=ids.dtype, device=ids.device).expand(pad, -1)
    return (torch.cat([x, x.new_zeros(pad, x.shape[1])]), torch.cat([ids, spare]),
            torch.cat([weights, weights.new_zeros(pad, weights.shape[1])]))


class EPDeepSeekMoE(nn.Module):
    """The reference model's DeepSeekMoE with its routed experts spread over an EP group."""

    def __init__(self, block: DeepSeekMoE, experts: EPExperts) -> None:
        super().__init__()
        self.gate = block.gate
        self.shared_experts = block.shared_experts
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        topk_weights, topk_ids = self.gate(tokens)
        return (self.experts(tokens, topk_ids, topk_weights) + self.shared_experts(tokens)).view_as(x)

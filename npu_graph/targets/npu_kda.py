"""NPU lowering of the KDA core for short sequences: `ascend_dsa.chunk_kda` and `chunk_kda_states` over at most
RECURRENT_MAX_T tokens (speculative decoding's verify window of k + 1 tokens, short catch-up forwards).

The pinned torch_npu 7.3.0 table has no KDA op. op-plugin's `npu_recurrent_gated_delta_rule` is the fused
counterpart serving stacks use (its `gk` is KDA's per-channel decay; `ssm_state_indices` and
`num_accepted_tokens` give each token its state slot for speculative decoding), but it is not in the pinned
table: its signature was not read from the 7.3.0 docs, and it takes bf16 q, k, v and state, where the verify
graph's checkpoints are fp32 (bitwise the states of the accepted tokens). So for these T the program runs the
recurrence step by step in torch ops, which torch_npu runs on the device — fla's fused_recurrent form, what the
CPU kernel runs for them: each step is a few batched ops over all rows and heads, and the state after each step
goes to its slot of the `states` output, from which a rollback selects per row with a device-side gather
(KDASlots.rollback_). Longer sequences (prefill) keep the composite, labelled.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from npu_graph.kernels.kda.chunk_kda import RECURRENT_MAX_T
from npu_graph.targets.npu_ops import Emission, Lowering

FLOOR = -80.0   # chunk_kda's floor on the log decay (exp(-80) is 0 at fp32 precision)
NO_OP = ("no KDA op in the pinned torch_npu 7.3.0 (op-plugin's npu_recurrent_gated_delta_rule, bf16, is not in "
         "the pinned table)")


def _recurrence(lo: Lowering, a: dict[str, Any], num_states: int | None) -> Emission | str:
    """The step recurrence of `lo.node` (chunk_kda or chunk_kda_states) as program lines, or why not."""
    batch, steps, heads, dim_k = a["k"].meta["val"].shape
    if steps > RECURRENT_MAX_T:
        return f"{NO_OP}; {steps} tokens are a prefill, run by the chunked kernel"
    dim_v = a["v"].meta["val"].shape[-1]
    text, n = lo.names.text, lo.node.name
    scale = a["scale"] if a["scale"] is not None else dim_k ** -0.5
    state = (f"{text(a['initial_state'])}.float()" if a["initial_state"] is not None else
             f"torch.zeros({batch}, {heads}, {dim_k}, {dim_v}, dtype=torch.float32, device={text(a['k'])}.device)")
    lo.out.decomposed = NO_OP
    lo.line(f"# decomposition: {NO_OP}; the recurrence over its {steps} tokens in torch ops on the device, all rows "
            f"and heads of a step at once" + (", the state after each step into its slot" if num_states else ""))
    lo.line(f"{n}_q, {n}_k, {n}_v = {text(a['q'])}.float() * {scale!r}, {text(a['k'])}.float(), "
            f"{text(a['v'])}.float()")
    lo.line(f"{n}_a = {text(a['g'])}.float().clamp(min={FLOOR}).exp().unsqueeze(-1)")
    lo.line(f"{n}_b = {text(a['beta'])}.float().unsqueeze(-1)")
    lo.line(f"{n}_s, {n}_o, {n}_st = {state}, [], []")
    lo.line(f"for {n}_t in range({steps}):")
    lo.line(f"    {n}_s = {n}_s * {n}_a[:, {n}_t]")
    lo.line(f"    {n}_d = ({n}_v[:, {n}_t] - torch.einsum('bhk,bhkv->bhv', {n}_k[:, {n}_t], {n}_s)) * {n}_b[:, {n}_t]")
    lo.line(f"    {n}_s = {n}_s + {n}_k[:, {n}_t].unsqueeze(-1) * {n}_d.unsqueeze(-2)")
    lo.line(f"    {n}_o.append(torch.einsum('bhk,bhkv->bhv', {n}_q[:, {n}_t], {n}_s))")
    if num_states:
        lo.line(f"    {n}_st.append({n}_s)")
    out = f"torch.stack({n}_o, dim=1).to({lo.node.meta['val'][0].dtype})"
    if num_states is not None:
        states = (f"torch.stack({n}_st[:{num_states}], dim=1)" if num_states else
                  f"{n}_s.new_empty({batch}, 0, {heads}, {dim_k}, {dim_v})")
        return lo.assign(f"({out}, {n}_s, {states})")
    final = f"{n}_s" if a["output_final_state"] else f"{n}_s.new_empty(0)"
    return lo.assign(f"({out}, {final})")


def _chunk_kda(lo: Lowering, a: dict[str, Any]) -> Emission | str:
    return _recurrence(lo, a, None)


def _chunk_kda_states(lo: Lowering, a: dict[str, Any]) -> Emission | str:
    return _recurrence(lo, a, a["num_states"])


KDA_LOWERINGS: dict[str, Callable[[Lowering, dict[str, Any]], Emission | str]] = {
    "chunk_kda": _chunk_kda,
    "chunk_kda_states": _chunk_kda_states,
}

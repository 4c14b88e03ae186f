"""A KDA layer's cache (`KDALayerCache`: recurrent and convolution state) and the per-position records of its
multi-token forward (`KDASlots`), so that its state can be rolled back.

A speculative verify forward feeds W tokens per sequence; the KDA recurrent state and the short-convolution
window absorb all of them, but only a prefix may be accepted. `KDASlots`, attached to a layer's cache
(`KDALayerCache.slots`), makes the forward keep what a rollback needs, in one of two ways:

- "checkpoint" (vLLM): the entering state and the state after each position, from the same pass
  (`ascend_dsa.chunk_kda_states`), and the convolution window before and after each position. Rolling back to
  n accepted positions selects slot n: a device-side gather, bitwise the state a forward over the accepted
  tokens alone computes.
- "replay" (TensorRT-LLM): the entering state and window and the core's inputs (q, k, v, g, beta, and the
  convolution's inputs). Rolling back runs the recurrence again over the accepted positions from the entering
  state, the rejected ones masked (g = 0, beta = 0: those steps leave the state exactly as it is), and takes
  the window from the entering one and the accepted inputs.

`rollback_(layer, accepted)` restores both states of the layer for `accepted` `[B]` int (positions kept per
sequence, 0..T; rows may differ). Memory per layer and sequence: checkpoint W + 1 states ((W + 1)·H·K·V floats),
replay one state and W·H·(4·K + 1) input floats.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("checkpoint", "replay")


@dataclass
class KDALayerCache:
    """Recurrent state of one KDA layer."""

    state: torch.Tensor
    conv_state: torch.Tensor
    slots: KDASlots | None = None  # set by npu_graph.generate for a verify forward


@dataclass
class KDASlots:
    """What one KDA layer keeps of its last multi-token forward (module docstring); W = `width` positions."""

    mode: str
    width: int
    states: torch.Tensor        # [B, 1 + W, H, K, V] checkpoint (slot 0: entering), [B, 1, ...] replay
    windows: torch.Tensor       # [B, 1 + W, C, conv-1] checkpoint (slot 0: entering), [B, 1, ...] replay
    core: torch.Tensor | None   # replay: q, k, v, g [B, W, 4, H, D] (K == V == D)
    beta: torch.Tensor | None   # replay: [B, W, H]
    mixed: torch.Tensor | None  # replay: the convolution's inputs [B, C, W]

    @classmethod
    def new(cls, layer: KDALayerCache, mode: str, width: int) -> KDASlots:
        """Empty slots for `layer`'s shapes."""
        if mode not in MODES:
            raise ValueError(f"KDASlots: unknown rollback mode {mode!r}; use one of {MODES}")
        batch, heads, dim_k, dim_v = layer.state.shape
        keep = 1 + width if mode == "checkpoint" else 1
        states = layer.state.new_zeros(batch, keep, heads, dim_k, dim_v)
        windows = layer.conv_state.new_zeros(batch, keep, *layer.conv_state.shape[1:])
        if mode == "checkpoint":
            return cls(mode, width, states, windows, None, None, None)
        if dim_k != dim_v:
            raise ValueError(f"KDASlots: replay packs q, k, v and g together and needs K == V; got {dim_k}, {dim_v}")
        core = layer.state.new_zeros(batch, width, 4, heads, dim_k)
        mixed = layer.conv_state.new_zeros(batch, layer.conv_state.shape[1], width)
        return cls(mode, width, states, windows, core, layer.state.new_zeros(batch, width, heads), mixed)

    def record_inputs(self, layer: KDALayerCache, mixed: torch.Tensor) -> None:
        """Before the forward updates `layer`: the entering state, and the convolution windows before and after
        each position (checkpoint) or the entering window and the convolution's inputs `mixed` `[B, C, T]`."""
        seq = mixed.shape[-1]
        self._check_width(seq)
        self.states[:, 0].copy_(layer.state)
        if self.mode == "replay":
            self.windows[:, 0].copy_(layer.conv_state)
            self.mixed[..., :seq].copy_(mixed)
            return
        window = torch.cat((layer.conv_state, mixed), dim=-1)
        every = window.unfold(-1, layer.conv_state.shape[-1], 1)                # [B, C, 1 + T, conv-1]
        self.windows[:, :seq + 1].copy_(every.transpose(1, 2))

    def core_(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The KDA core over all T positions from `state` `[B, H, K, V]`, keeping the checkpoints or the inputs;
        returns (o `[B, T, H, V]` in v's dtype, the final state)."""
        seq = k.shape[1]
        if self.mode == "checkpoint":
            o, final, states = torch.ops.ascend_dsa.chunk_kda_states(q, k, v, g, beta, scale, state.float(),
                                                                     num_states=seq)
            self.states[:, 1:seq + 1].copy_(states)
            return o.to(v.dtype), final
        self.core[:, :seq].copy_(torch.stack((q, k, v, g), dim=2))
        self.beta[:, :seq].copy_(beta)
        o, final = torch.ops.ascend_dsa.chunk_kda(q, k, v, g, beta, scale, state.float(), output_final_state=True)
        return o.to(v.dtype), final

    def rollback_(self, layer: KDALayerCache, accepted: torch.Tensor, scale: float) -> None:
        """Restore `layer`'s recurrent state and convolution window to those after the first `accepted[b]`
        positions of the last forward (0 <= accepted <= its T), per sequence."""
        accepted = accepted.long()
        rows = torch.arange(accepted.shape[0], device=accepted.device)
        if self.mode == "checkpoint":
            layer.state.copy_(self.states[rows, accepted])
            layer.conv_state.copy_(self.windows[rows, accepted])
            return
        keep = torch.arange(self.width, device=accepted.device) < accepted.unsqueeze(1)   # [B, W]
        q, k, v, g = self.core.unbind(dim=2)
        g = torch.where(keep[:, :, None, None], g, torch.zeros_like(g))
        beta = torch.where(keep[:, :, None], self.beta, torch.zeros_like(self.beta))
        _, final = torch.ops.ascend_dsa.chunk_kda(q, k, v, g, beta, scale, self.states[:, 0],
                                                  output_final_state=True)
        layer.state.copy_(final)
        width = layer.conv_state.shape[-1]
        window = torch.cat((self.windows[:, 0], self.mixed), dim=-1)                    # [B, C, conv-1 + W]
        index = (accepted.unsqueeze(1) + torch.arange(width, device=accepted.device)).unsqueeze(1)
        layer.conv_state.copy_(window.gather(-1, index.expand(-1, window.shape[1], -1)))

    def _check_width(self, seq: int) -> None:
        if seq > self.width:
            raise ValueError(f"KDASlots: a forward of {seq} tokens does not fit {self.width} slots; make the slots "
                             f"at least as wide as the verify window")

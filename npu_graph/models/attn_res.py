"""Block Attention Residuals (Kimi "Attention Residuals"): sublayer inputs are a softmax over depth.

Instead of h = h + f(h), sublayer outputs are summed into blocks of `attn_res_block_size` decoder layers, and the
input of every sublayer (attention and MLP each) is

    h = sum_i softmax_i(w . RMSNorm(v_i)) v_i,   v_i in {embedding, completed block sums..., current partial sum}

with a learned pseudo-query w `[D]` per sublayer. w starts at zero, which makes h the plain mean of the sources.
"""
import torch
from torch import nn

from npu_graph.models.norm import RMSNorm


class AttnRes(nn.Module):
    """One sublayer's depth attention: `forward(sources)` with every source `[B, T, D]` -> `[B, T, D]`."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(dim))
        self.norm = RMSNorm(dim, eps)

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        values = torch.stack(sources)
        keys = self.norm(values)
        logits = torch.einsum("d,nbtd->nbt", self.query, keys)
        weights = logits.softmax(dim=0)
        return torch.einsum("nbt,nbtd->btd", weights, values)

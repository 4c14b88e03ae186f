"""Shared pieces of the speculative decoding tests: a tiny model with an MTP head, prompts of different lengths,
and a Decoder whose drafts are the true greedy tokens with chosen ones spoiled (forced rejections)."""
import dataclasses

import torch

from npu_graph.generate import Decoder
from npu_graph.models.attn_res import AttnRes
from npu_graph.models.hybrid import HybridConfig, HybridLM


def mtp_model(seed: int = 0) -> HybridLM:
    """The tiny config with an MTP head and random AttnRes queries (zeros would make every residual a mean)."""
    torch.manual_seed(seed)
    model = HybridLM(dataclasses.replace(HybridConfig.named("tiny"), mtp_layers=1)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, AttnRes):
                module.query.normal_(std=0.5)
    return model


def prompts(lengths: list[int], seed: int = 1, vocab: int = 256) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]


class OracleDecoder(Decoder):
    """Drafts the reference greedy tokens `truth` [B, >= steps + k], spoiling draft j of row b in round r where
    j = (r + b) % (k + 1) (j = k: none spoiled, all accepted; none at all without `spoil`): every window position
    is rejected in turn, and the rows of one verify accept different lengths."""

    def __init__(self, model: HybridLM, truth: torch.Tensor, prompt_lengths: list[int], spoil: bool = True,
                 **kwargs: object) -> None:
        super().__init__(model, **kwargs)
        self.truth = truth
        self.prompt_lengths = torch.tensor(prompt_lengths)
        self.spoil = spoil

    def _draft(self, state, mtp_cache, k, stats):
        super()._draft(state, mtp_cache, k, stats)
        done = mtp_cache.lengths.long() - (k - 1) - self.prompt_lengths + 1   # tokens emitted per row
        index = (done.unsqueeze(1) + torch.arange(k)).clamp(max=self.truth.shape[1] - 1)
        drafts = self.truth.gather(1, index)
        if not self.spoil:
            return drafts
        rows = torch.arange(drafts.shape[0])
        spoil = (stats.rounds + rows) % (k + 1)
        wrong = (drafts + 1) % self.model.config.vocab_size
        return torch.where(torch.arange(k) == spoil.unsqueeze(1), wrong, drafts)

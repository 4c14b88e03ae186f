"""Decode loops for the reference HybridLM that own its caches: plain greedy and speculative greedy decoding.

`Decoder(model, compiled=...)` prefills a batch of prompts (of different lengths too) and decodes greedily, one
token per forward (`greedy`), or speculatively (`speculative`): the model's MTP head drafts k tokens, one
forward of the main model verifies k + 1, the longest matching prefix plus the corrected token is kept, the
paged DSA caches are truncated by length and the KDA states rolled back (`rollback.py`: per-position checkpoints
or replay). Both give the tokens plain greedy decoding gives.
"""
from npu_graph.generate.decoder import Decoder, SpecStats
from npu_graph.generate.prefill import Prefilled

__all__ = ["Decoder", "Prefilled", "SpecStats"]

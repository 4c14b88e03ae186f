"""Speculative decoding compiled with backend="ascend_dsa": the tokens of eager plain greedy decoding, one verify
graph (and one MTP catch-up graph) per k, and nothing compiled again as the context grows (Dynamo's counters);
with quant="dsa", the tokens of plain decoding with the same quantization."""
import dataclasses

import pytest
import torch
from spec_helpers import OracleDecoder, mtp_model, prompts
from torch._dynamo.utils import counters

from npu_graph.generate import Decoder
from npu_graph.models.hybrid import HybridConfig, HybridLM

LENGTHS = [9, 14, 6]
OPTIONS = {"cache": False, "verify": False}


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
def test_compiled_speculative_is_greedy_with_one_graph_per_k(rollback):
    model = mtp_model()
    truth = Decoder(model).greedy(prompts(LENGTHS), 30)
    decoder = OracleDecoder(model, truth, LENGTHS, compiled=True, options=OPTIONS)
    counters.clear()
    out, _ = decoder.speculative(prompts(LENGTHS), 8, 2, rollback)
    assert torch.equal(out, truth[:, :8])
    # the padded prefill, the MTP head over the prompts, one MTP step, and for k = 2 the catch-up and the verify
    assert graphs() == 5
    out, _ = decoder.speculative(prompts(LENGTHS), 24, 2, rollback)        # a longer context: nothing new
    assert torch.equal(out, truth[:, :24]) and graphs() == 5
    out, _ = decoder.speculative(prompts(LENGTHS), 12, 3, rollback)        # another k: its two graphs
    assert torch.equal(out, truth[:, :12]) and graphs() == 7
    assert not [r for r in decoder.backend.reports if r.fallback]


@pytest.mark.slow
def test_compiled_quant_dsa_speculative_is_quant_dsa_greedy():
    """quant="dsa" (FP8 latent cache, MXFP8 indexer): speculative decoding gives plain decoding's tokens under
    the same quantization."""
    torch.manual_seed(0)
    model = HybridLM(dataclasses.replace(HybridConfig.named("stdlib"), mtp_layers=1)).eval()
    options = {**OPTIONS, "quant": "dsa"}
    lengths = [12, 7]
    plain = Decoder(model, compiled=True, options=options, kv_dtype=torch.float8_e4m3fn)
    truth = plain.greedy(prompts(lengths), 12)
    oracle = OracleDecoder(model, truth, lengths, compiled=True, options=options, kv_dtype=torch.float8_e4m3fn)
    out, stats = oracle.speculative(prompts(lengths), 8, 2)
    assert torch.equal(out, truth[:, :8]) and 0 < stats.acceptance_rate < 1
    assert not [r for r in plain.backend.reports if r.fallback]

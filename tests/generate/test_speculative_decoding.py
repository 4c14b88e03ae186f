"""npu_graph.generate: speculative greedy decoding (MTP drafts, one verify forward, KDA rollback by checkpoint
slots or replay) gives exactly the tokens of plain greedy decoding, for k = 1..4, prompts of different lengths
and rows that accept different lengths in one verify; drafts that are right are accepted."""
import dataclasses

import pytest
import torch
from spec_helpers import OracleDecoder, mtp_model, prompts

from npu_graph.generate import Decoder
from npu_graph.generate.decoder import pad_prompts
from npu_graph.models.hybrid import HybridConfig, HybridLM, generate_greedy

LENGTHS = [9, 14, 6]
STEPS = 10
FAST = {(1, "checkpoint"), (4, "replay"), (2, "checkpoint")}


def grid(ks: list[int]) -> list:
    """(k, rollback) pairs; those outside FAST run with the slow tests."""
    return [pytest.param(k, mode, marks=[] if (k, mode) in FAST else [pytest.mark.slow])
            for k in ks for mode in ("checkpoint", "replay")]


@pytest.fixture(scope="module")
def model():
    return mtp_model()


@pytest.fixture(scope="module")
def truth(model):
    """Plain greedy tokens of the prompts, long enough for the oracle's drafts past STEPS."""
    return Decoder(model).greedy(prompts(LENGTHS), STEPS + 4)


def test_greedy_of_equal_prompts_is_generate_greedy(model):
    ids = torch.stack(prompts([8, 8]))
    expected = generate_greedy(model, ids, 6, model.new_cache(2))
    assert torch.equal(Decoder(model).greedy(ids, 6), expected)


def test_ragged_prefill_equals_each_prompt_alone(model, truth):
    for row, prompt in enumerate(prompts(LENGTHS)):
        alone = generate_greedy(model, prompt.unsqueeze(0), 4, model.new_cache(1))
        assert torch.equal(truth[row, :4], alone[0]), f"prompt {row} of length {prompt.numel()}"


@pytest.mark.parametrize(("k", "rollback"), grid([1, 2, 3, 4]))
def test_mtp_drafts_give_greedy_tokens(model, truth, k, rollback):
    out, stats = Decoder(model).speculative(prompts(LENGTHS), STEPS, k, rollback)
    assert torch.equal(out, truth[:, :STEPS])
    assert stats.rounds >= 1 and stats.drafted >= k * len(LENGTHS)
    assert 0.0 <= stats.acceptance_rate <= 1.0


@pytest.mark.parametrize(("k", "rollback"), grid([1, 2, 3, 4]))
def test_forced_rejections_at_every_position(model, truth, k, rollback):
    """Drafts are the greedy tokens with one spoiled at a position that moves every round and differs per row."""
    decoder = OracleDecoder(model, truth, LENGTHS)
    out, stats = decoder.speculative(prompts(LENGTHS), STEPS, k, rollback)
    assert torch.equal(out, truth[:, :STEPS])
    assert stats.accepted > 0 and stats.acceptance_rate < 1.0


def test_right_drafts_are_all_accepted(model, truth):
    out, stats = OracleDecoder(model, truth, LENGTHS, spoil=False).speculative(prompts(LENGTHS), STEPS, 3)
    assert torch.equal(out, truth[:, :STEPS])
    assert stats.acceptance_rate == 1.0 and stats.mean_accepted_length == 4.0


def test_fp8_cache_speculative_is_fp8_greedy():
    """A float8 DSA cache (quant="dsa"'s storage): rows rewritten after a rollback are quantized per token again,
    so speculative decoding gives the tokens plain decoding with the same cache gives."""
    torch.manual_seed(0)
    model = HybridLM(dataclasses.replace(HybridConfig.named("stdlib"), mtp_layers=1)).eval()
    decoder, lengths = Decoder(model, kv_dtype=torch.float8_e4m3fn), [12, 7]
    truth = decoder.greedy(prompts(lengths), 10)
    oracle = OracleDecoder(model, truth, lengths, kv_dtype=torch.float8_e4m3fn)
    out, stats = oracle.speculative(prompts(lengths), 6, 2)
    assert torch.equal(out, truth[:, :6]) and 0 < stats.acceptance_rate < 1


def test_errors(model):
    with pytest.raises(ValueError, match="no MTP head"):
        Decoder(HybridLM(HybridConfig.named("tiny"))).speculative(prompts([4]), 2, 1)
    with pytest.raises(ValueError, match="max_context"):
        Decoder(model).speculative(prompts([200]), 60, 4)
    with pytest.raises(ValueError, match="k"):
        Decoder(model).speculative(prompts([4]), 2, 0)
    with pytest.raises(ValueError, match="1-D"):
        pad_prompts([torch.zeros(2, 2, dtype=torch.long)])

"""Prefill in chunks (npu_graph.generate.prefill): the tokens, drafts and acceptance of one whole-prompt forward,
for ragged prompts too; a Prefilled decodes several times from copies and is left as it was."""
import pytest
import torch
from spec_helpers import mtp_model, prompts

from npu_graph.generate import Decoder

LENGTHS = [9, 14, 6]


@pytest.fixture(scope="module")
def model():
    return mtp_model()


@pytest.mark.parametrize("chunk", [2, 5])
def test_chunked_prefill_decodes_as_one_forward(model, chunk):
    whole, chunked = Decoder(model, prefill_chunk=None), Decoder(model, prefill_chunk=chunk)
    assert torch.equal(chunked.greedy(prompts(LENGTHS), 8), whole.greedy(prompts(LENGTHS), 8))
    state = chunked.prefill(prompts(LENGTHS), draft=True)
    assert state.start == (min(LENGTHS) - 1) // chunk * chunk > 0
    assert torch.equal(state.mtp_cache.lengths, torch.full((3,), state.start, dtype=torch.int32))
    expected, expected_stats = whole.speculative(prompts(LENGTHS), 10, 2)
    out, stats = chunked.speculative(prompts(LENGTHS), 10, 2)
    assert torch.equal(out, expected)
    # the MTP head read the chunks as the catch-up would have: the same drafts, so the same acceptance
    assert (stats.drafted, stats.accepted) == (expected_stats.drafted, expected_stats.accepted)


def test_a_prefilled_decodes_from_copies(model):
    decoder = Decoder(model, prefill_chunk=4)
    state = decoder.prefill(prompts(LENGTHS), draft=True)
    lengths = state.cache.lengths.clone()
    first = decoder.greedy(state, 6)
    out, _ = decoder.speculative(state, 6, 3)
    assert torch.equal(decoder.greedy(state, 6), first) and torch.equal(out, first)
    assert torch.equal(first, decoder.greedy(prompts(LENGTHS), 6))
    assert torch.equal(state.cache.lengths, lengths)


def test_drafting_needs_the_mtp_cache_and_room(model):
    decoder = Decoder(model)
    with pytest.raises(ValueError, match="draft=True"):
        decoder.speculative(decoder.prefill(prompts(LENGTHS)), 4, 2)
    with pytest.raises(ValueError, match="max_context"):
        decoder.greedy(decoder.prefill(prompts([200])), 60)

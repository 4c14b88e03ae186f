"""KDA state rollback after a multi-token (verify) forward, for every accepted length of the window and different
ones per row: the checkpoint slot selected is bitwise the state that replaying only the accepted positions from
the committed state gives (and the convolution window too), the rejected tokens leave no trace (bitwise), and
the kept states and the next token's logits match a forward of the accepted tokens alone. That last comparison
is close, not bitwise: a forward of fewer tokens rounds some elementwise ops differently (a [3, 2, 2] sigmoid runs
scalar, a [3, 5, 2] one vectorised), and a one-token forward takes the decode path."""
import copy

import pytest
import torch
from spec_helpers import mtp_model

from npu_graph.generate.rollback import attach_slots, detach_slots, keep_prefix_
from npu_graph.models.cache import KDALayerCache
from npu_graph.models.kda_slots import KDASlots

WINDOW = 5


@pytest.fixture(scope="module")
def setup():
    """The model, a cache holding prompts of different lengths, and a verify window of tokens."""
    model = mtp_model()
    generator = torch.Generator().manual_seed(2)
    cache = model.new_cache(3)
    with torch.no_grad():
        model(torch.randint(0, 256, (3, 11), generator=generator), cache)
    cache.lengths.copy_(torch.tensor([11, 7, 9]))        # rows of different committed lengths
    window = torch.randint(0, 256, (3, WINDOW), generator=generator)
    return model, cache, window


def kda_states(cache):
    return [(layer.state, layer.conv_state) for layer in cache.layers if isinstance(layer, KDALayerCache)]


@torch.no_grad()
def verify_then_keep(model, cache, window, mode, accepted):
    cache = copy.deepcopy(cache)
    start = cache.lengths.long().clone()
    attach_slots(cache, mode, WINDOW)
    model(window, cache)
    keep_prefix_(cache, start, accepted, model.config.kda_head_dim ** -0.5)
    detach_slots(cache)
    return cache


@torch.no_grad()
def accepted_alone(model, cache, window, accepted):
    cache = copy.deepcopy(cache)
    if accepted:
        model(window[:, :accepted], cache)
    return cache


@pytest.mark.parametrize("accepted", range(WINDOW + 1))
def test_every_accepted_length_equals_the_accepted_tokens_alone(setup, accepted):
    model, cache, window = setup
    expected = accepted_alone(model, cache, window, accepted)
    kept = {mode: verify_then_keep(model, cache, window, mode, torch.full((3,), accepted))
            for mode in ("checkpoint", "replay")}
    for mode, got in kept.items():
        assert torch.equal(got.lengths, expected.lengths), mode
        for (state, conv), (want_state, want_conv) in zip(kda_states(got), kda_states(expected)):
            torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(conv, want_conv, rtol=1e-5, atol=1e-5)
    for (a, b), (c, d) in zip(kda_states(kept["checkpoint"]), kda_states(kept["replay"])):
        assert torch.equal(a, c) and torch.equal(b, d)


@pytest.mark.parametrize("mode", ["checkpoint", "replay"])
def test_rows_keep_different_lengths_and_rejected_tokens_leave_no_trace(setup, mode):
    model, cache, window = setup
    accepted = torch.tensor([0, 3, 5])
    kept = verify_then_keep(model, cache, window, mode, accepted)
    other = window.clone()
    other[1, 3:] = (other[1, 3:] + 7) % 256
    kept_other = verify_then_keep(model, cache, other, mode, accepted)
    for row, n in enumerate(accepted.tolist()):
        expected = accepted_alone(model, cache, window, n)
        for (state, conv), (other_state, other_conv), (want_state, want_conv) in zip(
                kda_states(kept), kda_states(kept_other), kda_states(expected)):
            torch.testing.assert_close(state[row], want_state[row], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(conv[row], want_conv[row], rtol=1e-5, atol=1e-5)
            assert torch.equal(state[row], other_state[row]) and torch.equal(conv[row], other_conv[row])
    assert kept.lengths.tolist() == [11, 10, 14]


def test_decoding_continues_as_from_the_accepted_tokens(setup):
    """The next token's logits after the rollback (stale rows of the paged caches past the new lengths) equal
    those after a forward of the accepted tokens alone, row by row."""
    model, cache, window = setup
    accepted = torch.tensor([2, 4, 1])
    token = torch.tensor([[1], [2], [3]])
    with torch.no_grad():
        logits = model(token, verify_then_keep(model, cache, window, "checkpoint", accepted))
        for row, n in enumerate(accepted.tolist()):
            expected = model(token, accepted_alone(model, cache, window, n))
            torch.testing.assert_close(logits[row], expected[row], rtol=1e-5, atol=1e-5)


def test_slots_refuse_a_wider_forward_and_unknown_modes(setup):
    model, cache, window = setup
    cache = copy.deepcopy(cache)
    attach_slots(cache, "checkpoint", 2)
    with pytest.raises(ValueError, match="does not fit 2 slots"), torch.no_grad():
        model(window, cache)
    layer = next(x for x in cache.layers if isinstance(x, KDALayerCache))
    with pytest.raises(ValueError, match="unknown rollback mode"):
        KDASlots.new(layer, "rewind", 3)
    detach_slots(cache)
    with pytest.raises(ValueError, match="attach_slots"):
        keep_prefix_(cache, cache.lengths.long(), torch.ones(3, dtype=torch.long), 1.0)

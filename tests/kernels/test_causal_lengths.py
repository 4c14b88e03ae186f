"""ascend_dsa::causal_lengths through the native check (kernels/native/causal_lengths.c) and through the torch
path (ASCEND_DSA_NATIVE=0), both against the row-by-row reference: bool and additive masks, broadcast
(stride-0) masks, more queries than keys, batches of different lengths, left-padded batches (windows=True: each
row's key start); and the errors for masks that are not right-down causal, that start past key 0 without
windows, or hold other additive values."""
import pytest
import torch
from native_paths import native_and_torch

from npu_graph.kernels.checks import FusedPreconditionError
from npu_graph.kernels.indexer import causal_lengths as module
from npu_graph.kernels.indexer.causal_lengths import reference_causal_lengths

OP = torch.ops.ascend_dsa.causal_lengths
path = native_and_torch(module.NATIVE_SOURCE)


def causal_mask(key_lengths: list[int], rows: int, keys: int, starts: list[int] | None = None) -> torch.Tensor:
    """Bool [B, rows, keys]: batch b's row t sees keys [start_b, L_b - (rows - 1 - t)) (start 0 by default)."""
    t = torch.arange(rows).view(1, rows, 1)
    limit = torch.tensor(key_lengths).view(-1, 1, 1) - (rows - 1 - t)
    first = torch.tensor(starts or [0] * len(key_lengths)).view(-1, 1, 1)
    positions = torch.arange(keys).view(1, 1, keys)
    return (positions < limit) & (positions >= first)


def additive(mask: torch.Tensor, masked: float = float("-inf")) -> torch.Tensor:
    return torch.zeros(mask.shape).masked_fill(~mask, masked)


def check(mask: torch.Tensor, is_additive: bool, path: str, windows: bool = False) -> tuple[torch.Tensor, ...]:
    used = module._native_lengths(mask, is_additive, windows) is not None
    assert used == (path == "native" and mask.dtype in (torch.bool, torch.float32))
    got = OP(mask, is_additive, windows)
    want = reference_causal_lengths(mask, is_additive, windows)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert all(g.dtype == torch.int32 for g in got)
    return got


@pytest.mark.parametrize(("lengths", "rows", "keys"), [
    ([16384], 1, 16640), ([5, 9, 1], 1, 12), ([7, 12], 4, 12), ([3], 6, 10), ([0, 4], 2, 8), ([10], 10, 10)])
@pytest.mark.parametrize("kind", ["bool", "additive_inf", "additive_finite", "additive_bf16"])
def test_lengths_match_reference(lengths, rows, keys, kind, path):
    mask = causal_mask(lengths, rows, keys)
    if kind == "bool":
        check(mask, False, path)
        return
    dtype = torch.bfloat16 if kind == "additive_bf16" else torch.float32
    check(additive(mask, -1e30 if kind == "additive_finite" else float("-inf")).to(dtype), True, path)


def test_broadcast_mask(path):
    """The fusion passes expand a [1, 1, keys] mask over the batch: stride 0 along it."""
    mask = causal_mask([6], 1, 9).expand(3, 1, 9)
    assert mask.stride(0) == 0
    check(mask, False, path)


def flipped(row: int, key: int, visible: bool):
    def change(mask: torch.Tensor) -> torch.Tensor:
        mask[0, row, key] = visible
        return mask
    return change


@pytest.mark.parametrize("change", [flipped(0, 2, False), flipped(1, 7, True), flipped(0, 4, True)],
                         ids=["hole_in_prefix", "key_after_prefix", "row_sees_too_much"])
@pytest.mark.parametrize("is_additive", [False, True])
def test_not_causal_raises(change, is_additive, path):
    mask = change(causal_mask([6], 3, 9))
    with pytest.raises(FusedPreconditionError, match="not right-down causal"):
        OP(additive(mask) if is_additive else mask, is_additive)


def test_other_additive_values_raise(path):
    mask = additive(causal_mask([4], 1, 8))
    mask[0, 0, 6] = -1.0
    with pytest.raises(FusedPreconditionError, match=r"additive `mask` must hold 0 \(visible\) or a value <= -1e30"):
        OP(mask, True)


@pytest.mark.parametrize(("lengths", "starts", "rows", "keys"), [
    ([12, 12, 12], [0, 5, 8], 1, 12),        # decode of a left-padded batch
    ([12, 12, 12], [0, 5, 8], 12, 12),       # its prefill: the padding's query rows see nothing
    ([9, 16], [3, 0], 4, 16), ([7], [7], 3, 10)])
@pytest.mark.parametrize("is_additive", [False, True])
def test_left_padded_windows_give_each_row_its_start(lengths, starts, rows, keys, is_additive, path):
    mask = causal_mask(lengths, rows, keys, starts)
    _, got_k, got_start = check(additive(mask) if is_additive else mask, is_additive, path, windows=True)
    seen = [s if n > s else 0 for s, n in zip(starts, lengths)]
    assert got_start.tolist() == seen and got_k.tolist() == [n if n > s else 0 for s, n in zip(starts, lengths)]


@pytest.mark.parametrize("is_additive", [False, True])
def test_a_start_past_key_0_needs_windows(is_additive, path):
    mask = causal_mask([9], 2, 9, [4])
    with pytest.raises(FusedPreconditionError, match="not right-down causal"):
        OP(additive(mask) if is_additive else mask, is_additive)


@pytest.mark.parametrize("change", [flipped(0, 2, True), flipped(2, 6, False), flipped(0, 8, True)],
                         ids=["padding_row_sees_a_key", "hole_in_window", "row_sees_too_much"])
def test_windows_that_are_not_causal_raise(change, path):
    mask = change(causal_mask([9], 3, 9, [4]))
    with pytest.raises(FusedPreconditionError, match="not right-down causal"):
        OP(mask, False, True)

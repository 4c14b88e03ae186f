"""Zigzag layout: which chunks each rank holds, exact round trip, causal balance, clear errors."""
import pytest
import torch

from npu_graph.parallel import zigzag_restore, zigzag_split


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_round_trip_and_chunk_layout(cp, dim):
    x = torch.randn(16, 24, 16)
    parts = [zigzag_split(x, cp, r, dim) for r in range(cp)]
    assert torch.equal(zigzag_restore(parts, cp, dim), x)
    chunk = x.shape[dim] // (2 * cp)
    for r, part in enumerate(parts):
        first = x.narrow(dim, r * chunk, chunk)
        last = x.narrow(dim, (2 * cp - 1 - r) * chunk, chunk)
        assert torch.equal(part, torch.cat([first, last], dim))


def test_causal_work_is_balanced():
    length, cp = 4096, 4
    positions = torch.arange(length)
    work = [zigzag_split(positions + 1, cp, r, 0).sum().item() for r in range(cp)]
    contiguous = [(positions + 1).chunk(cp)[r].sum().item() for r in range(cp)]
    assert max(work) / (sum(work) / cp) <= 1.01 < max(contiguous) / (sum(contiguous) / cp)


def test_clear_errors():
    with pytest.raises(ValueError, match="30 along dim 1 is not divisible by 2·cp_size = 8"):
        zigzag_split(torch.zeros(1, 30), 4, 0, dim=1)
    with pytest.raises(ValueError, match="cp_rank 4 is outside"):
        zigzag_split(torch.zeros(1, 32), 4, 4, dim=1)
    with pytest.raises(ValueError, match="expected 2 parts"):
        zigzag_restore([torch.zeros(4)], 2, dim=0)

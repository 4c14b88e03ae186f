"""npu_graph.runtime.weight_arena: the prologue's own tensors move into one huge-page arena with their values;
views, tensors sharing an input's storage, small and non-tensor values stay; a compiled graph's results are
unchanged."""
import torch

from npu_graph.runtime import weight_arena


def test_materialised_tensors_move_with_their_values():
    param = torch.randn(256, 512)
    own = param.t().contiguous()                        # a pre-transposed copy: the graph's own
    stacked = torch.randn(4, 128, 64)
    view_of_param = param.t()
    shares_input = param.view(-1)
    small = torch.randn(8, 8)
    values = (own, stacked, view_of_param, shares_input, small, 3, None)
    moved, nbytes = weight_arena.pack(values, [param])
    assert nbytes >= own.nbytes + stacked.nbytes
    for before, after in zip(values, moved):
        if isinstance(before, torch.Tensor):
            assert torch.equal(before, after) and after.dtype == before.dtype and after.shape == before.shape
        else:
            assert after is before
    assert moved[0].data_ptr() != own.data_ptr() and moved[1].data_ptr() != stacked.data_ptr()
    assert moved[0].data_ptr() % weight_arena.HUGE_PAGE == 0        # the arena starts on a 2 MiB boundary
    assert all(moved[i] is values[i] for i in (2, 3, 4))
    assert moved[0].is_contiguous() and moved[1].is_contiguous()


def test_nothing_to_move():
    values = (torch.randn(4), 1.0)
    assert weight_arena.pack(values, []) == (values, 0)


def test_grad_and_offset_tensors_stay():
    base = torch.randn(64 << 10)
    values = (torch.randn(128, 256, requires_grad=True), base[1:])
    moved, nbytes = weight_arena.pack(values, [])
    assert nbytes == 0 and all(a is b for a, b in zip(values, moved))

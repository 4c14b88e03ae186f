"""kernels/huge_pages: zeroed tensors of the asked shape and dtype, on a 2 MiB boundary when they span a huge page
(plain torch.zeros below), usable like any tensor (written, copied, saved)."""
import copy
import io

import pytest
import torch

from npu_graph.kernels import huge_pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8])
def test_large_tensors_start_on_a_huge_page_and_are_zero(dtype):
    t = huge_pages.zeros(64, 64, 1, 512, dtype=dtype)
    assert t.shape == (64, 64, 1, 512) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not t.float().any()


def test_small_tensors_are_plain_zeros():
    t = huge_pages.zeros(4, 8)
    assert t.shape == (4, 8) and not t.any()


def test_written_copied_and_saved_like_any_tensor():
    t = huge_pages.zeros(1024, 1024)
    t[3, 5] = 7.0
    t.index_put_((torch.tensor([9]), torch.tensor([1])), torch.tensor([2.0]))
    for other in (copy.deepcopy(t), t.clone()):
        assert torch.equal(other, t) and other.data_ptr() != t.data_ptr()
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer), t)


def test_a_system_without_private_mappings_gets_plain_zeros(monkeypatch):
    monkeypatch.delattr(huge_pages.mmap, "MAP_PRIVATE")
    t = huge_pages.zeros(1024, 1024)
    assert t.shape == (1024, 1024) and not t.any()

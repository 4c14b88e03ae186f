"""npu_graph.runtime.serial_calls: small calls of the ATen ops that fork a thread team for tiny work run on one thread
(same kernel, same result), larger ones keep the team; the runtime binds them so."""
import pytest
import torch

from npu_graph.runtime import direct_calls
from npu_graph.runtime.serial_calls import SMALL_ELEMENTS, serial_when_small


def recording(results):
    def fn(*args):
        results.append(torch.get_num_threads())
        return torch.bmm(*args) if len(args) == 2 and args[0].dim() == 3 else args[0]
    return fn


def test_small_bmm_runs_on_one_thread_and_restores_the_count():
    threads = torch.get_num_threads()
    seen = []
    bmm = serial_when_small("bmm.default", recording(seen))
    a, b = torch.randn(4, 1, 32), torch.randn(4, 32, 16)
    assert torch.equal(bmm(a, b), torch.bmm(a, b))
    assert seen == [1 if threads > 1 else threads] and torch.get_num_threads() == threads


def test_large_calls_keep_the_thread_team():
    threads = torch.get_num_threads()
    seen = []
    bmm = serial_when_small("bmm.default", recording(seen))
    softmax = serial_when_small("_softmax.default", recording(seen))
    bmm(torch.randn(8, 128, 128), torch.randn(8, 128, 128))
    softmax(torch.randn(SMALL_ELEMENTS + 1))
    assert seen == [threads, threads]


def test_an_error_inside_restores_the_thread_count():
    threads = torch.get_num_threads()

    def failing(*args):
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        serial_when_small("topk.default", failing)(torch.randn(3))
    assert torch.get_num_threads() == threads


def test_other_overloads_are_returned_unchanged_and_the_runtime_binds_the_listed_ones():
    assert serial_when_small("mul.Tensor", torch.mul) is torch.mul
    bmm = direct_calls.DIRECT.aten("bmm", "default")
    assert bmm is not torch.bmm
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    assert torch.equal(bmm(a, b), torch.bmm(a, b))


def test_small_products_and_layer_norm_are_listed_with_their_work():
    """mm / addmm count multiply-adds (a prefill's [64, 64] @ [64, 128] is 512K: kept on the team); layer norm
    counts elements."""
    threads = torch.get_num_threads()
    seen = []
    mm = serial_when_small("mm.default", recording(seen))
    addmm = serial_when_small("addmm.default", recording(seen))
    layer_norm = serial_when_small("native_layer_norm.default", recording(seen))
    mm(torch.randn(4, 64), torch.randn(64, 64))
    mm(torch.randn(64, 64), torch.randn(64, 128))
    addmm(torch.randn(16), torch.randn(2, 16), torch.randn(16, 16))
    layer_norm(torch.randn(64, 32))
    one = 1 if threads > 1 else threads
    assert seen == [one, threads, one, one]


def test_one_row_products_are_called_as_they_are_under_mkl():
    """MKL multiplies a single row on the calling thread: such a product skips the thread-count switch; with
    another BLAS it is switched like any small product."""
    threads = torch.get_num_threads()
    seen = []
    mm = serial_when_small("mm.default", recording(seen))
    addmm = serial_when_small("addmm.default", recording(seen))
    mm(torch.randn(1, 64), torch.randn(64, 92))
    addmm(torch.randn(16), torch.randn(1, 16), torch.randn(16, 16))
    expected = threads if torch.backends.mkl.is_available() else (1 if threads > 1 else threads)
    assert seen == [expected, expected]

"""The fused ops' static argument checks: run once per signature of their arguments, and their error messages
formatted only when a check fails."""
import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from npu_graph.kernels import checks


def _counting_check():
    calls = []

    @checks.once_per_signature
    def check(x: torch.Tensor, width: int, mode: str | None) -> None:
        calls.append((tuple(x.shape), width, mode))
        checks.require_rank("op", "x", x, 2)
        checks.require_choice("op", "mode", mode, ("a", None))

    return check, calls


def test_a_signature_that_passed_is_not_checked_again_and_a_new_one_is():
    check, calls = _counting_check()
    x = torch.zeros(2, 3)
    for _ in range(3):
        check(x, 4, "a")
    check(torch.ones(2, 3), 4, "a")                 # other data, same signature
    assert len(calls) == 1
    check(torch.zeros(2, 5), 4, "a")                # another shape
    check(x, 5, "a")                                # another plain argument
    check(x, 4, None)
    check(x.double(), 4, "a")                       # another dtype
    check(torch.zeros(2, 3, device="meta"), 4, "a")     # another device
    assert len(calls) == 6


def test_a_failing_signature_raises_at_every_call():
    check, calls = _counting_check()
    check(torch.zeros(2, 3), 4, "a")
    for _ in range(2):
        with pytest.raises(ValueError, match="`mode`='b' is not supported"):
            check(torch.zeros(2, 3), 4, "b")
        with pytest.raises(ValueError, match="must have rank 2, got shape \\(3,\\)"):
            check(torch.zeros(3), 4, "a")
    assert len(calls) == 5


def test_symbolic_sizes_nested_tensors_and_unhashable_arguments_are_checked_every_time():
    calls = []

    @checks.once_per_signature
    def check(size: object) -> None:
        calls.append(size)

    env = ShapeEnv()
    symbolic = env.create_symintnode(env.create_symbol(5, ConstantSource("s0")), hint=5)
    nested = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(4, 3)])     # no sizes to key by
    for _ in range(2):
        check(torch.Size([symbolic, 4]))
        check([1, 2])
        check(nested)
    assert len(calls) == 6


def test_a_remembered_signature_does_not_let_another_option_through():
    """rms_norm's checks after a valid call: the same tensors with a negative epsilon still fail."""
    x, gamma = torch.randn(1, 1, 8), torch.ones(8)
    torch.ops.ascend_dsa.rms_norm(x, gamma, 1e-6)
    with pytest.raises(ValueError, match="`epsilon` must be >= 0"):
        torch.ops.ascend_dsa.rms_norm(x, gamma, -1.0)
    with pytest.raises(ValueError, match="`gamma` of shape \\(4,\\) must equal the trailing dimensions"):
        torch.ops.ascend_dsa.rms_norm(x, torch.ones(4), 1e-6)


def test_the_require_helpers_format_only_on_failure():
    class Loud:
        def __str__(self) -> str:
            raise AssertionError("formatted although the check passed")

        __repr__ = __str__

    loud = Loud()
    checks.require_choice("op", "x", loud, (loud,))
    checks.require_same("op", "a and b", loud, loud)
    with pytest.raises(AssertionError, match="formatted"):
        checks.require_same("op", "a and b", loud, Loud())

"""The call-sequence fuzzer (tests/kernels/call_sequences.py) in a subprocess: sequences of calls of every fused op
with state, interleaved with in-place changes, aliasing, native modes and instruction-set levels, each call's
result, torch path and reference agreeing. The default run replays the same derandomized sequences (~20 s);
the slow run draws new ones, 20,000 calls and more."""
import re
from pathlib import Path

import pytest
from native_paths import LEVELS
from test_fuzz_native import run_program

from npu_graph.kernels.native import loader as native

PROGRAM = Path(__file__).with_name("call_sequences.py")
pytestmark = pytest.mark.skipif(not native.available("sparse_attention")[0], reason="no native kernels built")


def calls_compared(level: str, *args: str, timeout: int) -> int:
    (line,) = run_program(PROGRAM, level, *args, timeout=timeout)
    return int(re.fullmatch(r"ok (\d+) calls compared", line).group(1))


def test_call_sequences():
    assert calls_compared(LEVELS[-1], "--examples", "40", "--steps", "50", timeout=600) > 300


@pytest.mark.slow
def test_call_sequences_new_cases():
    assert calls_compared(LEVELS[-1], "--examples", "1500", "--steps", "60", "--random", timeout=3600) >= 20000

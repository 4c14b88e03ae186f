"""The fuzz program (tests/kernels/fuzz_ops.py) in a subprocess per instruction-set level: native and torch paths
agree on random shapes, strides, dtypes, index ranges and special values, with no crash (a signal) and no hang (a
timeout). The default run replays the same derandomized cases; the slow run draws new ones."""
import os
import subprocess
import sys
from pathlib import Path

import fuzz_ops
import pytest
from native_paths import LEVELS

from npu_graph.kernels.native import loader as native

PROGRAM = Path(__file__).with_name("fuzz_ops.py")
pytestmark = pytest.mark.skipif(not native.available("sparse_attention")[0], reason="no native kernels built")


def run_program(program: Path, level: str, *args: str, timeout: int) -> list[str]:
    """A fuzz program in a subprocess (ASCEND_DSA_NATIVE=1, ASCEND_DSA_CPU_ISA=level); fails the test on a hang, a
    crash (naming the last case or call it wrote to stderr) or a difference. Returns its "ok ..." lines."""
    env = {**os.environ, "ASCEND_DSA_CPU_ISA": level, "ASCEND_DSA_NATIVE": "1"}
    try:
        done = subprocess.run([sys.executable, str(program), *args], capture_output=True, text=True, env=env,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        last = (e.stderr or b"").decode(errors="replace").strip().splitlines()[-1:]
        pytest.fail(f"hang: {program.name} at {level} passed {timeout} s; last case: {last}")
    cases = [line for line in done.stderr.splitlines() if line.startswith(("CASE", "CALL"))]
    if done.returncode < 0:
        pytest.fail(f"crash (signal {-done.returncode}) at {level} in {cases[-1] if cases else 'start-up'}")
    assert done.returncode == 0, f"disagreement at {level}:\n{done.stdout[-800:]}\n{done.stderr[-3000:]}"
    return [line for line in done.stdout.splitlines() if line.startswith("ok ")]


def run_fuzz(level: str, *args: str, timeout: int) -> None:
    assert len(run_program(PROGRAM, level, *args, timeout=timeout)) == len(fuzz_ops.FUZZERS)


@pytest.mark.parametrize("level", LEVELS)
def test_fuzz_native_against_torch(level):
    run_fuzz(level, "--examples", "25", timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_fuzz_native_against_torch_new_cases(level):
    run_fuzz(level, "--examples", "300", "--random", timeout=1800)

"""The native kernels built with AddressSanitizer and UndefinedBehaviorSanitizer (ASCEND_DSA_NATIVE_CFLAGS, into a
fresh ASCEND_DSA_NATIVE_DIR) under the fuzz program, the bad-input probe and the native kernel tests (the
call-sequence fuzzer among them), in a subprocess whose Python has the sanitizer runtimes preloaded: any
out-of-bounds access or undefined behaviour aborts it. Slow (~10 min)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from native_paths import LEVELS

from npu_graph.kernels.native import cpu_isa
from npu_graph.kernels.native import loader as native

HERE = Path(__file__).parent
SANITIZE = "-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
NATIVE_TESTS = ["test_bad_inputs.py", "test_indexer_native.py", "test_indexer_threads.py", "test_sfa_native.py",
                "test_kda_native.py", "test_dense_attention.py", "test_depthwise_conv1d.py", "test_skinny_mm.py",
                "test_skinny_bf16.py", "test_rms_norm.py", "test_attn_res.py", "test_moe_gating.py",
                "test_causal_lengths.py", "test_rotary_mul.py", "test_fused_moe.py", "test_call_sequences.py"]


def _runtimes() -> list[str]:
    cc = native.compiler()
    if cc is None or not cc.endswith(("gcc", "cc")):
        pytest.skip("the sanitizer run needs gcc")
    found = [subprocess.run([cc, f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
             for lib in ("libasan.so", "libubsan.so")]
    if not all(os.path.isabs(path) and os.path.exists(path) for path in found):
        pytest.skip(f"gcc has no sanitizer runtimes ({found})")
    return found


def _sanitized_env(tmp_path: Path, level: str) -> dict[str, str]:
    return {**os.environ, "LD_PRELOAD": " ".join(_runtimes()), "ASCEND_DSA_CPU_ISA": level,
            # allocator_may_return_null: a spoiled size that asks for tens of GB (the probe's references) gets torch's
            # own out-of-memory error, as without the sanitizer, instead of ending the process
            "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:allocator_may_return_null=1",
            "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
            "ASCEND_DSA_NATIVE_DIR": str(tmp_path), native.ENV_CFLAGS: SANITIZE}


def _check(done: subprocess.CompletedProcess, what: str) -> None:
    report = [line for line in done.stderr.splitlines() if "runtime error" in line or "AddressSanitizer" in line]
    assert done.returncode == 0 and not report, f"{what}: exit {done.returncode}\n" + "\n".join(
        report[:5] or done.stderr.splitlines()[-20:])


# The amx_bf16 kernels with their tile instructions in C (kernels/native/amx_emulated.h), on any CPU with
# AVX512-BF16: their buffers and indexing, not the hardware, are what the sanitizers check.
EMULATED_AMX = "amx_bf16 emulated"


@pytest.mark.slow
@pytest.mark.parametrize("level", [*LEVELS, *([EMULATED_AMX] if "avx512_bf16" in LEVELS else [])])
def test_fuzz_under_sanitizers(level, tmp_path):
    env = _sanitized_env(tmp_path, level.removesuffix(" emulated"))
    if level == EMULATED_AMX:
        env[cpu_isa.ENV_AMX_EMULATED] = "1"
    done = subprocess.run([sys.executable, str(HERE / "fuzz_ops.py"), "--examples", "60"], capture_output=True,
                          text=True, env=env, timeout=1800)
    _check(done, f"fuzz at {level}")
    assert any(name.endswith(".so") for name in os.listdir(tmp_path))        # the sanitized builds ran


@pytest.mark.slow
def test_native_kernel_tests_under_sanitizers(tmp_path):
    env = _sanitized_env(tmp_path, LEVELS[-1])
    env.pop("ASCEND_DSA_CPU_ISA")            # the tests set every level themselves
    # amx_bf16 among them wherever AVX512-BF16 is, its tiles emulated in C even on AMX hardware: the sanitizers
    # see the emulation's memory accesses, not those of tile loads and stores
    env[cpu_isa.ENV_AMX_EMULATED] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           *(str(HERE / name) for name in NATIVE_TESTS)], capture_output=True, text=True, env=env,
                          timeout=3000, cwd=HERE.parent.parent)
    _check(done, "native kernel tests")


@pytest.mark.slow
def test_bad_input_probe_under_sanitizers(tmp_path):
    """Spoiled calls reach the kernels' edges (empty, strided, out-of-range): a sanitizer report ends its worker,
    which the probe records as a crash."""
    env = _sanitized_env(tmp_path, LEVELS[-1])
    done = subprocess.run([sys.executable, str(HERE / "bad_input_probe.py"), "--every", "3", "--paths", LEVELS[-1]],
                          capture_output=True, text=True, env=env, timeout=3000, cwd=HERE)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]

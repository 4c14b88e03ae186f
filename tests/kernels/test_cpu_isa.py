"""kernels/native/cpu_isa.py and the per-level native builds: detection from CPU flags, ASCEND_DSA_CPU_ISA forcing a
lower level (a level the CPU lacks or an unknown name is a clear error), one library per level, and every kernel source
compiling at every level (also those this CPU cannot execute, so that an AVX2 machine still checks the AVX-512
code)."""
import subprocess

import pytest
import torch

from npu_graph.kernels.native import cpu_isa
from npu_graph.kernels.native import loader as native

AVX2 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.mark.parametrize(("flags", "levels"), [
    (set(), ("generic",)),
    (AVX2 - {"fma"}, ("generic",)),
    (AVX2, ("generic", "avx2")),
    (AVX512 - {"avx512vl"}, ("generic", "avx2")),
    (AVX512, ("generic", "avx2", "avx512")),
    (AVX512 | {"avx512_bf16"}, cpu_isa.LEVELS[:4]),
    (AVX512 | {"avx512_bf16", "amx_tile"}, cpu_isa.LEVELS[:4]),       # tiles without bf16 tile products
    (AVX2 | {"avx512_bf16"}, ("generic", "avx2")),     # bf16 without AVX-512 adds nothing
])
def test_levels_from_flags(flags, levels):
    assert cpu_isa._levels_from_flags(flags) == levels


@pytest.mark.parametrize("granted", [True, False])
def test_amx_needs_the_tile_state_from_the_os(monkeypatch, granted):
    monkeypatch.setattr(cpu_isa, "_tile_state_granted", lambda: granted)
    levels = cpu_isa._levels_from_flags(AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"})
    assert levels == (cpu_isa.LEVELS if granted else cpu_isa.LEVELS[:4])


def test_this_cpu():
    levels = cpu_isa.supported()
    assert levels[0] == "generic" and levels == cpu_isa.LEVELS[:len(levels)]
    assert cpu_isa.best() == levels[-1]
    if not cpu_isa.is_x86():
        assert levels == ("generic",)


def test_forcing_a_level(monkeypatch):
    monkeypatch.delenv(cpu_isa.ENV_ISA, raising=False)
    assert cpu_isa.active() == cpu_isa.best()
    for level in cpu_isa.supported():
        monkeypatch.setenv(cpu_isa.ENV_ISA, level.upper())
        assert cpu_isa.active() == level


def test_unknown_level_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(cpu_isa.ENV_ISA, "sse9")
    with pytest.raises(cpu_isa.IsaError, match=r"'sse9' is not an instruction-set level; use one of"):
        cpu_isa.active()


def test_level_the_cpu_lacks_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cpu_isa, "supported", lambda: ("generic",))
    monkeypatch.setattr(cpu_isa, "_cpuinfo_flags", lambda: {"sse2"})
    monkeypatch.setenv(cpu_isa.ENV_ISA, "avx512")
    with pytest.raises(cpu_isa.IsaError, match=r"cannot execute avx512 code \(missing: .*avx2.*avx512f"):
        cpu_isa.active()
    with pytest.raises(cpu_isa.IsaError):       # the error reaches the op's caller, not a silent fallback
        native.load("rms_norm")


def test_each_level_loads_its_own_library(monkeypatch):
    if native.compiler() is None:
        pytest.skip("no C compiler")
    paths = set()
    for level in cpu_isa.supported():
        monkeypatch.setenv(cpu_isa.ENV_ISA, level)
        loaded = native.load("rms_norm")
        assert loaded, loaded.reason
        assert f"rms_norm-{level}-" in loaded.reason
        paths.add(loaded.reason)
        x = torch.randn(2, 64)
        y, _ = torch.ops.ascend_dsa.rms_norm(x, torch.ones(64), epsilon=1e-6)
        torch.testing.assert_close(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert len(paths) == len(cpu_isa.supported())


@pytest.mark.skipif(not cpu_isa.is_x86(), reason="the x86 levels are built on x86 only")
@pytest.mark.parametrize("level", [lv for lv in cpu_isa.LEVELS if lv not in cpu_isa.supported()])
def test_levels_this_cpu_cannot_run_still_compile(level, tmp_path):
    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    for source in sorted(native.SOURCE_DIR.glob("*.c")):
        done = subprocess.run([cc, *native.level_flags(level), "-o", str(tmp_path / "x.so"), str(source)],
                              capture_output=True, text=True, check=False)
        assert done.returncode == 0, f"{source.name} at {level}: {done.stderr[-2000:]}"

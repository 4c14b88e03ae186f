"""The amx_bf16 level's kernels on a CPU without AMX: ASCEND_DSA_AMX_EMULATED=1 builds them with the tile
instructions emulated in C (kernels/native/amx_emulated.h), and the indexer's and sparse attention's tests run at
that level in a subprocess (the setting is read once per process). Also the setting's checks and what it changes
in the build."""
import argparse
import ctypes
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cpu_isa import AVX512

from npu_graph.kernels.native import cpu_isa
from npu_graph.kernels.native import loader as native
from npu_graph.tools import bench

HERE = Path(__file__).parent
AMX_TESTS = ["test_amx_emulated.py", "test_indexer_native.py", "test_sfa_native.py"]
OPS = torch.ops.ascend_dsa
AVX512_BF16 = AVX512 | {"avx512_bf16"}


def _forget_the_setting() -> None:
    cpu_isa.amx_emulated.cache_clear()
    cpu_isa.supported.cache_clear()


@pytest.fixture
def amx_setting(monkeypatch):
    """Sets ASCEND_DSA_AMX_EMULATED for the test (read once per process: the cached readings are cleared before
    and after)."""
    def set_to(value: str) -> None:
        monkeypatch.setenv(cpu_isa.ENV_AMX_EMULATED, value)
        _forget_the_setting()
    yield set_to
    monkeypatch.undo()
    _forget_the_setting()


@pytest.fixture
def emulated(amx_setting):
    amx_setting("1")


def test_emulation_counts_amx_where_avx512_bf16_is(emulated, monkeypatch):
    monkeypatch.setattr(cpu_isa, "_tile_state_granted", lambda: False)
    assert cpu_isa._levels_from_flags(AVX512_BF16) == cpu_isa.LEVELS
    assert cpu_isa._levels_from_flags(AVX512_BF16 - {"avx512_bf16"}) == cpu_isa.LEVELS[:3]


def test_emulated_build_has_no_amx_flags(emulated):
    flags = native.level_flags("amx_bf16")
    if not cpu_isa.is_x86():
        pytest.skip("x86 levels only")
    assert "-DASCEND_DSA_AMX_EMULATED" in flags and not any(f.startswith("-mamx") for f in flags)
    assert "-mavx512bf16" in flags and "-mamx-tile" in native._X86_LEVEL_FLAGS["amx_bf16"]


def test_a_value_other_than_0_or_1_is_refused(amx_setting):
    amx_setting("yes")
    with pytest.raises(cpu_isa.IsaError, match="ASCEND_DSA_AMX_EMULATED='yes': use 1"):
        cpu_isa.amx_emulated()
    if cpu_isa.is_x86():
        with pytest.raises(cpu_isa.IsaError, match="ASCEND_DSA_AMX_EMULATED"):
            native.load("rms_norm")         # on every x86 CPU, at the first native call


def test_bench_refuses_to_time_emulated_tiles(emulated, capsys):
    args = argparse.Namespace(suite="kernels", isa=None, json=False)
    assert bench.run_bench(args) == 2
    assert "timings under it mean nothing" in capsys.readouterr().err


@pytest.mark.skipif(not cpu_isa.amx_emulated(), reason="runs in the emulated subprocess below")
def test_amx_bf16_tiles_reached_under_emulation(monkeypatch):
    """bf16 indexer and sparse attention calls at the emulated level run tile dot products (the kernels' tile
    paths are reachable: the tests above would pass on their AVX512-BF16 paths too)."""
    monkeypatch.setenv(cpu_isa.ENV_ISA, "amx_bf16")
    g = torch.Generator().manual_seed(0)
    bf16 = functools.partial(torch.randn, generator=g, dtype=torch.bfloat16)
    calls = {"lightning_indexer": lambda: OPS.lightning_indexer(bf16(1, 1, 16, 64), bf16(1, 300, 1, 64),
                                                                torch.randn(1, 1, 16), sparse_count=32),
             "sparse_attention": lambda: OPS.sparse_flash_attention(
                 bf16(1, 1, 16, 64), kv := bf16(1, 300, 1, 64), kv, torch.randperm(300)[:100].int().view(1, 1, 1, -1),
                 0.1, query_rope=bf16(1, 1, 16, 32), key_rope=bf16(1, 300, 1, 32))}
    for source, call in calls.items():
        products = native.load(source).lib.amx_emulated_products
        products.restype = ctypes.c_long
        before = products()
        call()
        assert products() > before, source


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler")
@pytest.mark.skipif("avx512_bf16" not in cpu_isa.supported(), reason="the emulated level needs AVX512-BF16")
def test_kernel_tests_pass_at_the_emulated_amx_level(tmp_path):
    env = {**os.environ, cpu_isa.ENV_AMX_EMULATED: "1", "ASCEND_DSA_NATIVE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "amx_bf16",
                           *(str(HERE / name) for name in AMX_TESTS)], capture_output=True, text=True, env=env,
                          timeout=1200, cwd=HERE.parent.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]
    assert any(name.startswith("sparse_attention-amx_bf16") for name in os.listdir(tmp_path))

"""aarch64: every native source builds with the flags kernels/native/loader.py uses there (the generic level: the
architecture's baseline, NEON), and the indexer's and sparse attention's kernels compute what plain C references
compute when run under qemu (tests/kernels/aarch64/kernels_check.c). Needs a cross compiler and qemu's user mode
(Debian: `apt-get install gcc-aarch64-linux-gnu qemu-user`); skipped where they are missing."""
import shutil
import subprocess
from pathlib import Path

import pytest

from npu_graph.kernels.native import loader as native

CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
SYSROOT = Path("/usr/aarch64-linux-gnu")
pytestmark = pytest.mark.skipif(not (CC and QEMU and SYSROOT.is_dir()),
                                reason="no aarch64 cross compiler, qemu-aarch64 or aarch64 sysroot")


@pytest.mark.parametrize("source", sorted(p.name for p in native.SOURCE_DIR.glob("*.c")))
def test_every_native_source_builds_for_aarch64(source, tmp_path):
    done = subprocess.run([CC, *native.FLAGS, "-Wall", "-o", str(tmp_path / "lib.so"), str(native.SOURCE_DIR / source),
                           "-lm"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr[-3000:]


def test_indexer_and_sparse_attention_compute_on_aarch64(tmp_path):
    check = Path(__file__).parent / "aarch64" / "kernels_check.c"
    flags = [f for f in native.FLAGS if f not in ("-shared", "-fPIC")]
    kernels = [str(native.SOURCE_DIR / f"{name}.c") for name in ("lightning_indexer", "sparse_attention")]
    built = subprocess.run([CC, *flags, "-o", str(tmp_path / "check"), str(check), *kernels, "-lm"],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    ran = subprocess.run([QEMU, "-L", str(SYSROOT), str(tmp_path / "check")], capture_output=True, text=True,
                         timeout=600)
    lines = ran.stdout.splitlines()
    assert ran.returncode == 0 and len(lines) == 4 and all(line.endswith(": ok") for line in lines), ran.stdout

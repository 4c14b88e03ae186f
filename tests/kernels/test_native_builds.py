"""Every native source builds and loads at every instruction-set level this CPU can execute, where a C compiler
is on the machine: a source that stopped compiling sends its op to the torch path, which the op tests alone would
not notice."""
import pytest
from native_paths import at_each_level, require_built

from npu_graph.kernels.native import loader as native

SOURCES = sorted(p.stem for p in native.SOURCE_DIR.glob("*.c"))


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("source", SOURCES)
def test_every_source_loads_at_every_level(source, monkeypatch):
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    for _ in at_each_level():
        require_built(source)

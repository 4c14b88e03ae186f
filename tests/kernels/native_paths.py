"""Fixtures for ops with a native kernel. `native_and_torch(source)` makes a `path` fixture: the test runs through
the native kernel once per instruction-set level this CPU can execute (kernels/native/cpu_isa.py; skipped where no C
compiler exists, failed where the source does not build) and once through the torch path (ASCEND_DSA_NATIVE=0).
`isa_level` runs a test once per level; `at_each_level` loops over the levels inside one test (for tests whose
reference is costly); `refuse` makes a path raise so a test shows that the other one did the work."""
import contextlib
import os
from collections.abc import Iterator

import pytest

from npu_graph.kernels.native import cpu_isa
from npu_graph.kernels.native import loader as native

LEVELS = cpu_isa.supported()


def native_and_torch(source: str):
    """The `path` fixture for kernels/native/<source>.c; its value is "native" (at each level) or "torch"."""

    @pytest.fixture(params=["torch", *(f"native-{level}" for level in LEVELS)])
    def path(request, monkeypatch):
        if request.param == "torch":
            monkeypatch.setenv(native.ENV_SWITCH, "0")
            return "torch"
        if native.compiler() is None:
            pytest.skip(f"native kernel not available: {native.NO_COMPILER}")
        monkeypatch.setenv(native.ENV_SWITCH, "1")     # force: auto would measure, and might take the torch path
        monkeypatch.setenv(cpu_isa.ENV_ISA, request.param.removeprefix("native-"))
        require_built(source)
        return "native"

    return path


# What gcc and clang say about a flag they do not know (an older compiler than the CPU, e.g. -mamx-tile before gcc
# 11), and what kernels/native/loader.py says when the compiler CC names cannot be started: that level cannot be built
# on this machine at all, which is not the source's fault.
COMPILER_LACKS_LEVEL = ("unrecognized command-line option", "unrecognized command line option", "unknown argument",
                        "could not run the C compiler")


def require_built(source: str) -> None:
    """Fails unless kernels/native/<source>.c is loaded at the level in force, where a C compiler exists (skips
    where the compiler does not know that level's flags or cannot be started): the ops quietly take their torch
    paths when a library does not build, which would pass every native test."""
    loaded, why = native.available(source)
    if loaded or native.compiler() is None:
        return
    if any(words in why for words in COMPILER_LACKS_LEVEL):
        pytest.skip(f"the C compiler cannot build the {cpu_isa.active()} level: {why[-300:]}")
    pytest.fail(f"kernels/native/{source}.c did not build or load at {cpu_isa.active()}: {why}")


@pytest.fixture(params=LEVELS)
def isa_level(request, monkeypatch) -> str:
    """Runs the test once per instruction-set level this CPU can execute (ASCEND_DSA_CPU_ISA set to it)."""
    monkeypatch.setenv(cpu_isa.ENV_ISA, request.param)
    return request.param


@contextlib.contextmanager
def forced_level(level: str) -> Iterator[None]:
    """ASCEND_DSA_CPU_ISA=level inside, restored afterwards."""
    before = os.environ.get(cpu_isa.ENV_ISA)
    os.environ[cpu_isa.ENV_ISA] = level
    try:
        yield
    finally:
        if before is None:
            del os.environ[cpu_isa.ENV_ISA]
        else:
            os.environ[cpu_isa.ENV_ISA] = before


def at_each_level() -> Iterator[str]:
    """Yields each level this CPU can execute with ASCEND_DSA_CPU_ISA set to it for the loop body."""
    for level in LEVELS:
        with forced_level(level):
            yield level


def refuse(monkeypatch, owner: object, *names: str, said: str) -> None:
    """Replace `owner.<name>` for each name with a function that raises AssertionError(said)."""
    def raising(*args, **kwargs):
        raise AssertionError(said)
    for name in names:
        monkeypatch.setattr(owner, name, raising)

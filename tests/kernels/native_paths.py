"""A `path` fixture for ops with a native kernel: the test runs once through the native kernel (skipped where it
cannot be built) and once through the torch path (ASCEND_DSA_NATIVE=0); `refuse`, which makes a path raise so a
test shows that the other one did the work."""
import pytest

from npu_graph.kernels import native


def native_and_torch(source: str):
    """The `path` fixture for kernels/native/<source>.c; its value is "native" or "torch"."""
    loaded, why = native.available(source)

    @pytest.fixture(params=["native", "torch"])
    def path(request, monkeypatch):
        if request.param == "torch":
            monkeypatch.setenv(native.ENV_SWITCH, "0")
        elif not loaded:
            pytest.skip(f"native kernel not available: {why}")
        return request.param

    return path


def refuse(monkeypatch, owner: object, *names: str, said: str) -> None:
    """Replace `owner.<name>` for each name with a function that raises AssertionError(said)."""
    def raising(*args, **kwargs):
        raise AssertionError(said)
    for name in names:
        monkeypatch.setattr(owner, name, raising)

"""A `path` fixture for ops with a native kernel: the test runs once through the native kernel (skipped where it
cannot be built) and once through the torch path (ASCEND_DSA_NATIVE=0)."""
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

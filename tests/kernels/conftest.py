"""Fixtures for the kernel tests: `isa_level` (native_paths) runs a test once per instruction-set level;
`dispatch_table` gives a test measured dispatch with an empty table of its own."""
import pytest
from native_paths import isa_level  # noqa: F401

from npu_graph.kernels.native import call_plans, dispatch
from npu_graph.kernels.native import loader as native


@pytest.fixture
def dispatch_table(monkeypatch, tmp_path):
    """Measured dispatch (ASCEND_DSA_NATIVE=auto) with an empty table kept in tmp_path; its path."""
    monkeypatch.setenv(native.ENV_SWITCH, "auto")
    monkeypatch.setattr(dispatch, "table_path", lambda: tmp_path / "dispatch-test.json")
    monkeypatch.setattr(dispatch, "_table", None)
    monkeypatch.setattr(dispatch, "_known", {})
    monkeypatch.setattr(dispatch, "_provisional", {})
    monkeypatch.setattr(call_plans, "_CLEAR_AT", [])
    return tmp_path / "dispatch-test.json"

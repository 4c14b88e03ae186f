"""kernels/native/env_settings: the native kernels' settings are read at every call outside a compiled graph, and once
per call of a compiled graph (a change takes effect at the graph's next call)."""
import torch

import npu_graph
from npu_graph.kernels.native import cpu_isa, env_settings
from npu_graph.kernels.native import loader as native


def test_outside_a_graph_each_read_sees_the_environment(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert not native.load("rms_norm")
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    assert env_settings.get(native.ENV_SWITCH) == "1"


def test_inside_frozen_the_settings_on_entry_hold(monkeypatch):
    monkeypatch.setenv(cpu_isa.ENV_ISA, "generic")
    with env_settings.frozen():
        monkeypatch.setenv(cpu_isa.ENV_ISA, "not-a-level")
        assert cpu_isa.active() == "generic"
        with env_settings.frozen():
            assert env_settings.get(cpu_isa.ENV_ISA) == "not-a-level"
        assert env_settings.get(cpu_isa.ENV_ISA) == "generic"
    assert env_settings.get(cpu_isa.ENV_ISA) == "not-a-level"


def test_a_compiled_graph_reads_the_switch_at_each_call(monkeypatch):
    seen = []
    real_load = native.load

    def watching_load(name):
        seen.append(env_settings.get(native.ENV_SWITCH))
        return real_load(name)

    monkeypatch.setattr(native, "load", watching_load)
    rms = torch.compile(lambda x, g: torch.ops.ascend_dsa.rms_norm(x, g, 1e-6)[0],
                        backend=npu_graph.get_backend({"cache": False}))
    x, g = torch.randn(2, 8), torch.randn(8)
    for switch in ("1", "0"):
        monkeypatch.setenv(native.ENV_SWITCH, switch)
        seen.clear()
        rms(x, g)
        assert seen and set(seen) == {switch}

"""TORCH_LOGS=ascend_dsa and TORCH_LOGS=ascend_dsa_code: torch accepts them at import, without importing
npu_graph then, and they show the backend's messages and each graph's generated code."""
import logging
import os
import subprocess
import sys

import npu_graph_torch_logs

PROGRAM = """
import logging, os, sys, torch
print("npu_graph imported by torch:", "npu_graph" in sys.modules)

def compile_one(width):
    m = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 8)).eval()
    with torch.no_grad():
        torch.compile(m, backend="ascend_dsa", options={"cache": False})(torch.randn(2, 8))

compile_one(16)
print("--- now ascend_dsa", file=sys.stderr, flush=True)
del os.environ["TORCH_LOGS"]  # torch ignores set_logs while it is set
torch._logging.set_logs(modules={"ascend_dsa": logging.INFO})
compile_one(32)
"""


def test_torch_logs_names_work_from_import_torch_on():
    """TORCH_LOGS=ascend_dsa_code at import shows the code; the `ascend_dsa` name (registered with it) shows
    the backend's messages. Either name alone makes torch register both (test_only_our_names_...)."""
    env = {**os.environ, "TORCH_LOGS": "ascend_dsa_code"}
    done = subprocess.run([sys.executable, "-c", PROGRAM], env=env, cwd="/", capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "npu_graph imported by torch: False" in done.stdout
    code, messages = done.stderr.split("--- now ascend_dsa")
    assert "ascend_dsa: graph_0, compiled, cache bypass, code:" in code and "def " in code
    assert "ready in" not in code
    assert "ascend_dsa: graph_1 ready in" in messages and "[0/1]" in messages and "code:" not in messages


def test_only_our_names_register_at_torch_import(monkeypatch):
    named = npu_graph_torch_logs.named_in
    assert named("ascend_dsa") and named("+ascend_dsa") and named("dynamo, ascend_dsa_code")
    assert not named("") and not named("dynamo,+inductor") and not named("ascend_dsa_codes")
    registered = []
    monkeypatch.setattr(npu_graph_torch_logs, "register", lambda: registered.append(1))
    monkeypatch.setenv("TORCH_LOGS", "dynamo")
    npu_graph_torch_logs.register_at_torch_import()
    assert not registered  # left alone, npu_graph stays a plain Python logger
    monkeypatch.setenv("TORCH_LOGS", "+ascend_dsa")
    npu_graph_torch_logs.register_at_torch_import()
    assert registered


def test_a_failed_registration_does_not_fail_import_torch(monkeypatch, caplog):
    def broken():
        raise AttributeError("torch._logging changed")

    monkeypatch.setattr(npu_graph_torch_logs, "register", broken)
    monkeypatch.setenv("TORCH_LOGS", "ascend_dsa")
    with caplog.at_level(logging.WARNING, logger="npu_graph"):
        npu_graph_torch_logs.register_at_torch_import()
    assert "torch._logging changed" in caplog.text

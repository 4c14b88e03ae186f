"""The backend end to end on generic models: entry point, equality with eager, dynamic shapes, autograd,
fallback on a failing pass, strict mode, verify, and the dump."""
import glob
import json
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import npu_graph
from npu_graph import pipeline


def read_json(path):
    with open(path) as f:
        return json.load(f)


def compile_run(model, *args, options=None, **compile_kwargs):
    compiled = torch.compile(model, backend="ascend_dsa", options=options or {"cache": False}, **compile_kwargs)
    with torch.no_grad():
        return model(*args), compiled(*args)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 64), torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.b(F.gelu(self.a(x))).softmax(-1)


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 4, 3, stride=2)
        self.bn = torch.nn.BatchNorm2d(8)

    def forward(self, x):
        return self.c2(torch.relu(self.bn(self.c1(x)))).flatten(1).mean(-1)


class Attention(torch.nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads, self.qkv, self.o = heads, torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


def test_entry_point_lists_backend_without_importing_package():
    code = ("import torch, sys; print('ascend_dsa' in torch._dynamo.list_backends(None)); "
            "print('npu_graph' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]


@pytest.mark.parametrize("model, shape", [(MLP(), (4, 16)), (ConvNet().eval(), (2, 3, 12, 12)),
                                          (Attention(), (2, 10, 32))])
def test_compiled_equals_eager(model, shape):
    x = torch.randn(shape)
    ref, out = compile_run(model, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_dynamic_sequence_length_does_not_recompile():
    model, calls = Attention(), []
    backend = npu_graph.get_backend({"cache": False})

    def counting(gm, inputs, **kw):
        calls.append(1)
        return backend(gm, inputs)

    compiled = torch.compile(model, backend=counting)
    with torch.no_grad():
        for t in (8, 13, 21, 40):
            x = torch.randn(2, t, 32)
            torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert len(calls) == 1


def test_second_torch_compile_with_same_backend_does_not_recompile():
    model, x = MLP(), torch.randn(4, 16)
    backend = npu_graph.get_backend({"cache": False, "streams": 2})
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
        graphs = len(backend.reports)
        torch.compile(model, backend=npu_graph.get_backend({"streams": 2, "cache": False}))(x)
    assert len(backend.reports) == graphs


def test_training_graph_compiles_and_backpropagates():
    model, x = MLP(), torch.randn(4, 16)
    compiled = torch.compile(model, backend="ascend_dsa", options={"cache": False})
    compiled(x).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


def test_input_mutation_is_applied_once():
    def f(cache, x):
        cache.add_(x)
        return cache * 2

    cache, x = torch.zeros(4), torch.ones(4)
    out = torch.compile(f, backend="ascend_dsa", options={"cache": False})(cache, x)
    assert torch.equal(cache, torch.ones(4)) and torch.equal(out, torch.full((4,), 2.0))


@pytest.fixture
def failing_pass(monkeypatch):
    def run(gm, ctx):
        raise RuntimeError("boom in a pass")

    broken = types.SimpleNamespace(NAME="broken", INFERENCE_ONLY=False, run=run)
    monkeypatch.setattr(pipeline, "PASSES", [*pipeline.PASSES, broken])
    monkeypatch.setattr(pipeline, "pass_uuid", lambda p: "test")


def test_failing_pass_falls_back_to_eager_with_one_warning(failing_pass):
    model, x = MLP(), torch.randn(4, 16)
    with pytest.warns(npu_graph.backend.CompilationFallbackWarning, match="broken") as record:
        ref, out = compile_run(model, x)
    assert len([w for w in record if "broken" in str(w.message)]) == 1
    torch.testing.assert_close(out, ref)


def test_failing_pass_raises_in_strict_mode(failing_pass):
    with pytest.raises(Exception, match="boom in a pass"):
        compile_run(MLP(), torch.randn(4, 16), options={"cache": False, "strict": True})


def test_disabled_pass_is_skipped(tmp_path):
    dump = str(tmp_path)
    compile_run(MLP(), torch.randn(4, 16), options={"cache": False, "dump_dir": dump,
                                                     "disabled_passes": ["canonicalize"]})
    summary = read_json(glob.glob(os.path.join(dump, "*", "summary.json"))[0])
    skipped = {entry["name"]: entry.get("skipped") for entry in summary["passes"]}
    assert skipped["canonicalize"] == "disabled"


def test_verify_reports_mismatch(monkeypatch):
    def corrupt(gm, ctx):
        for node in gm.graph.nodes:
            if node.target == torch.ops.aten._softmax.default:
                with gm.graph.inserting_after(node):
                    bad = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 2.0))
                node.replace_all_uses_with(bad, delete_user_cb=lambda u, bad=bad: u is not bad)
        return pipeline.PassResult(changed=True)

    wrong = types.SimpleNamespace(NAME="wrong", INFERENCE_ONLY=False, run=corrupt)
    monkeypatch.setattr(pipeline, "PASSES", [*pipeline.PASSES, wrong])
    monkeypatch.setattr(pipeline, "pass_uuid", lambda p: "test")
    options = {"cache": False, "verify": True, "superkernel": False}  # keep the softmax node in the top graph
    with pytest.warns(UserWarning, match="differs from eager"):
        compile_run(MLP(), torch.randn(4, 16), options=options)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="differs from eager"):
        compile_run(MLP(), torch.randn(4, 16), options={**options, "strict": True})


def test_verify_passes_silently_when_equal(recwarn):
    ref, out = compile_run(MLP(), torch.randn(4, 16), options={"cache": False, "verify": True})
    torch.testing.assert_close(out, ref)
    assert not [w for w in recwarn if "differs" in str(w.message)]


def test_dump_has_stage_files_and_summary(tmp_path):
    compile_run(MLP(), torch.randn(4, 16), options={"cache": False, "dump_dir": str(tmp_path)})
    folder = glob.glob(os.path.join(str(tmp_path), "*"))[0]
    names = sorted(os.listdir(folder))
    assert {"00_captured.txt", "00_captured.json", "02_canonical_form.txt", "02_canonical_form.json",
            "compiled.py", "summary.json"} <= set(names)
    summary = read_json(os.path.join(folder, "summary.json"))
    for key in ["passes", "nodes_before", "nodes_after", "fused_ops", "target", "cache"]:
        assert key in summary
    stage = read_json(os.path.join(folder, "00_captured.json"))
    node = next(n for n in stage["nodes"] if n["op"] == "call_function")
    assert node["shapes"] and node["dtypes"] and node["created_by"] == "capture"


def test_unwritable_dump_dir_does_not_break_compilation(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    ref, out = compile_run(MLP(), torch.randn(4, 16), options={"cache": False, "dump_dir": str(blocker)})
    torch.testing.assert_close(out, ref)

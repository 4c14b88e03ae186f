"""layout_nz: every matmul weight gets an NZ or ND plan (node.meta["layout"] and the dump's `layouts`), and
the CPU target pre-transposes frozen weights once, in the parameter prologue, without changing a number."""
import json
from pathlib import Path

import pytest
import torch

import npu_graph
from npu_graph.passes import layout_nz


@pytest.mark.parametrize("dtype,fractal", [(torch.float32, [16, 16]), (torch.bfloat16, [16, 16]),
                                           (torch.float8_e4m3fn, [16, 32])])
def test_plan_fractal_by_element_size(dtype: torch.dtype, fractal: list[int]) -> None:
    layout = layout_nz.plan(torch.empty(64, 48, dtype=dtype), "auto")
    assert (layout["format"], layout["fractal"]) == ("FRACTAL_NZ", fractal)


@pytest.mark.parametrize("shape,nz", [((8, 128), "auto"), ((64,), "auto"), ((64, 64), "off")])
def test_plan_nd(shape: tuple[int, ...], nz: str) -> None:
    layout = layout_nz.plan(torch.empty(shape), nz)
    assert layout["format"] == "ND" and layout["fractal"] is None and layout["reason"]


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8, bias=False))


def compile_and_spy(monkeypatch, fn, args, options: dict, dump: Path):
    seen = {}
    original = layout_nz.run

    def spy(gm, ctx):
        result = original(gm, ctx)
        seen.update({n.name: n.meta.get("layout") for n in gm.graph.nodes if n.op == "placeholder"})
        return result

    monkeypatch.setattr(layout_nz, "run", spy)
    with torch.no_grad():
        ref = fn(*args)
        out = torch.compile(fn, backend="ascend_dsa", options={"cache": False, "dump_dir": str(dump),
                                                                **options})(*args)
    summary = json.loads(next(dump.rglob("summary.json")).read_text())
    source = next(dump.rglob("compiled.py")).read_text()
    return ref, out, seen, summary, source


def test_plans_are_in_meta_and_dump_and_cpu_weights_are_prepacked_once(monkeypatch, tmp_path) -> None:
    x = torch.randn(2, 64)
    ref, out, seen, summary, source = compile_and_spy(monkeypatch, mlp(), (x,), {}, tmp_path)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    planned = {name: layout["format"] for name, layout in seen.items() if layout}
    assert sorted(planned.values()) == ["FRACTAL_NZ", "ND"]        # the 8-row weight is too small for NZ
    layouts = summary["layouts"]
    assert layouts["counts"] == {"FRACTAL_NZ": 1, "ND": 1} and layouts["cpu_realised"] == 2
    assert {w["weight"] for w in layouts["weights"]} == set(planned)
    prologue, forward = source.split("def forward(")
    assert prologue.count("_aten_clone_default(") == 2 and "_aten_clone_default(" not in forward


def test_nz_off_plans_nd_and_keeps_weights(monkeypatch, tmp_path) -> None:
    ref, out, _, summary, source = compile_and_spy(monkeypatch, mlp(), (torch.randn(2, 64),), {"nz": "off"},
                                                   tmp_path)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    assert {w["format"] for w in summary["layouts"]["weights"]} == {"ND"}
    assert summary["layouts"]["cpu_realised"] == 0 and "_aten_clone_" not in source


def test_inputs_that_are_not_parameters_get_no_plan(monkeypatch, tmp_path) -> None:
    a, b = torch.randn(4, 32), torch.randn(32, 32)
    ref, out, seen, summary, _ = compile_and_spy(monkeypatch, torch.mm, (a, b), {}, tmp_path)
    torch.testing.assert_close(out, ref)
    assert summary["layouts"]["weights"] == [] and not any(seen.values())


def test_prologue_reruns_when_a_weight_changes() -> None:
    model = mlp()
    x = torch.randn(2, 64)
    compiled = torch.compile(model, backend=npu_graph.backend.Backend(
        npu_graph.CompilerConfig.from_options({"cache": False})))
    with torch.no_grad():
        compiled(x)
        model[0].weight.mul_(2.0)
        torch.testing.assert_close(compiled(x), model(x))

"""The bad-input probe (bad_input_probe.py) finds nothing: every spoiled call of every public fused op, on the
torch path and the native kernels, returns the reference's result or an error naming its argument. The default
run takes a thinned slice on the torch path and the best native level; the slow run every call on every level.
The probe's own judgement is tested too, on ops that are wrong on purpose."""
import dataclasses

import pytest
import torch
from bad_input_probe import cases, probe, verdict
from native_paths import LEVELS
from probe_specs import SPECS


def _describe(findings: list[dict]) -> str:
    return "\n".join(f"{r['path']} {r['op']}: `{r.get('argument')}` {r.get('spoiled')}: {r['verdict']}"
                     for r in findings[:20])


def test_a_slice_of_spoiled_calls_on_the_torch_path_and_the_best_level():
    results = probe(every=11, paths=["torch", LEVELS[-1]])
    assert len(results) >= 2 * len(cases(11)) > 200
    findings = [r for r in results if r["verdict"] != "ok"]
    assert not findings, _describe(findings)


@pytest.mark.slow
def test_every_spoiled_call_on_every_path():
    results = probe(every=1, paths=["torch", *LEVELS])
    assert len(results) >= 1500
    findings = [r for r in results if r["verdict"] != "ok"]
    assert not findings, _describe(findings)


def _norm_spec(op) -> object:
    spec = next(s for s in SPECS if s.name == "rms_norm")
    return dataclasses.replace(spec, op=op)


def _args() -> dict:
    spec = next(s for s in SPECS if s.name == "rms_norm")
    return spec.make(torch.Generator().manual_seed(0))


def test_the_probe_calls_a_result_off_the_reference_silently_wrong():
    reference = _norm_spec(None).reference
    wrong = _norm_spec(lambda *a, **k: tuple(t + 1e-2 for t in reference(*a, **k)))
    assert verdict(wrong, "x", "holds nan", _args()).startswith("silent wrong result")


def test_the_probe_wants_the_spoiled_argument_named_in_the_error():
    def refuses(*a, **k):
        raise ValueError("rms_norm: something is off")
    assert verdict(_norm_spec(refuses), "gamma", "rank + 1", _args()).startswith("error does not name `gamma`")
    assert verdict(_norm_spec(refuses), "something", "rank + 1", _args()) == "ok"


def test_the_probe_calls_other_exceptions_unclean_and_a_result_where_the_reference_refuses_a_finding():
    def breaks(*a, **k):
        raise ZeroDivisionError("x")
    assert verdict(_norm_spec(breaks), "x", "rank + 1", _args()).startswith("unclean error")
    accepts = _norm_spec(lambda x, gamma, epsilon=1e-6: (x, x))
    assert verdict(accepts, "gamma", "dim 0 + 1", {**_args(), "gamma": torch.ones(3)}).startswith("returned where")

"""A bad-input probe of every public fused op: from a valid call of each (tests/kernels/probe_specs.py) it spoils
one argument at a time — another rank, dtype or size, an empty dimension, a strided or expanded view, NaN or
infinite values, indices and lengths far out of range, a missing optional tensor, an option at 0, -1, 2**31,
2**63 - 1, NaN or inf — and runs each call through the native kernels and the torch path, against the reference.

Each call must end one of two ways: the reference's result (within tolerance, NaN where it has NaN), or an
error naming the spoiled argument. Anything else is a finding: a crash (a signal), a hang, a result that differs
from the reference's, a result where the reference refuses the call (or the reverse), or an error that does not
name its argument. Calls run in worker processes that print each call before it runs, so a crash or a hang is
pinned on its call and the rest go on in a new worker.

    python tests/kernels/bad_input_probe.py [--every N] [--json]
"""
import argparse
import json
import os
import subprocess
import sys
from collections import Counter

import torch
from probe_specs import SPECS, Spec

import npu_graph  # noqa: F401  (registers the ops)
from npu_graph.kernels.native import loader as native

CLEAN = (ValueError, RuntimeError, IndexError, TypeError, NotImplementedError, MemoryError)
INT_OPTIONS = [0, -1, 2 ** 31, 2 ** 63 - 1]
FLOAT_OPTIONS = [float("nan"), float("inf"), float("-inf"), 0.0, -1.0, 1e38]
TIMEOUT_S = 120


def tensor_spoils(t: torch.Tensor) -> list[tuple[str, object]]:
    """The spoiled versions of one tensor argument."""
    out: list[tuple[str, object]] = [("rank + 1", t.unsqueeze(0)), ("dtype float64", t.double()),
                                     ("dtype bool", t.bool())]
    if t.dim() > 1:
        out += [("rank - 1", t.flatten(0, 1)), ("strided", t.mT.contiguous().mT)]
    for d in range(t.dim()):
        out += [(f"dim {d} empty", t.narrow(d, 0, 0)), (f"dim {d} + 1", torch.cat([t, t.narrow(d, 0, 1)], d))]
        if t.shape[d] > 1:
            out.append((f"dim {d} expanded", t.narrow(d, 0, 1).expand(t.shape)))
    if t.dtype.is_floating_point and t.numel():
        for value in (float("nan"), float("inf"), float("-inf"), 3e38):
            bad = t.clone()
            bad.view(-1)[:: max(1, t.numel() // 3)] = value
            out.append((f"holds {value}", bad))
        out.append(("dtype int64", t.long()))
    elif not t.is_floating_point() and t.dtype != torch.bool and t.numel():
        for value in (-5, 2 ** 31, -2 ** 31 - 5, 2 ** 62):
            bad = t.long().clone()
            bad.view(-1)[-1] = value
            out.append((f"holds {value}", bad))
        out.append(("dtype float32", t.float()))
    return out


def spoils(args: dict) -> list[tuple[str, str, object]]:
    """(argument, how, value) for every spoiled version of every argument (None passed for a tensor too)."""
    found = []
    for name, value in args.items():
        if isinstance(value, torch.Tensor):
            found += [(name, how, bad) for how, bad in tensor_spoils(value)] + [(name, "None", None)]
        elif isinstance(value, bool):
            found.append((name, "not a bool", 2))
        elif isinstance(value, int):
            found += [(name, str(v), v) for v in INT_OPTIONS]
        elif isinstance(value, float):
            found += [(name, str(v), v) for v in FLOAT_OPTIONS]
        elif isinstance(value, str):
            found.append((name, "unknown choice", "BAD"))
    return found


def _outcome(spec: Spec, fn, args: dict):
    try:
        return spec.call(fn, args)
    except Exception as e:
        return e


def _as_tuple(x):
    return x if isinstance(x, (tuple, list)) else (x,)


def _differs(got, want) -> str | None:
    for g, w in zip(_as_tuple(got), _as_tuple(want)):
        if g is None or w is None:
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"shape/dtype {tuple(g.shape)} {g.dtype} vs {tuple(w.shape)} {w.dtype}"
        if not g.dtype.is_floating_point:
            if not torch.equal(g, w):
                return "integer outputs differ"
            continue
        gf, wf = g.float(), w.float()
        if not torch.equal(gf.isnan(), wf.isnan()):
            return "NaN in other places"
        scale = 1.0 + (wf.nan_to_num(0, 0, 0).abs().max().item() if wf.numel() else 0.0)
        tol = 1e-4 if g.dtype == torch.float32 else 3e-2
        if not torch.allclose(gf.nan_to_num(0, 1e30, -1e30), wf.nan_to_num(0, 1e30, -1e30), rtol=tol,
                              atol=tol * scale):
            return "values differ"
    return None


def verdict(spec: Spec, name: str, how: str, args: dict) -> str:
    """'ok' or what is wrong with this call on the path in force."""
    want = _outcome(spec, spec.reference, args)
    got = _outcome(spec, spec.op, args)
    if isinstance(got, Exception):
        text = f"{type(got).__name__}: {str(got)[:200]}"
        if not isinstance(got, CLEAN):
            return f"unclean error {text}"
        return "ok" if name in str(got) else f"error does not name `{name}`: {text}"
    if isinstance(want, Exception):
        return f"returned where the reference refuses: {type(want).__name__}: {str(want)[:160]}"
    if how.startswith("holds 3e+38"):       # overflow at the edge of fp32: where depends on the order of sums
        return "ok"
    if how == "1e+38":                      # an option at the edge of fp32: which outputs overflow to inf depends
        nan_where = [_nan_where(x) for x in (got, want)]    # on the order of sums; NaN must still match
        return "ok" if nan_where[0] == nan_where[1] else "silent wrong result: NaN in other places"
    if spec.name.startswith("lightning_indexer"):
        return _indexer_differs(got, want)
    if spec.name == "flash_attention_for_cpu" and how.startswith("holds") and name in ("key", "value"):
        return _fewer_nans(got, want)       # a masked row's NaN stays out of the native kernel (its docstring)
    problem = _differs(got, want)
    return "ok" if problem is None else f"silent wrong result: {problem}"


def _nan_where(outputs) -> list:
    return [t.isnan().nonzero().tolist() for t in _as_tuple(outputs) if isinstance(t, torch.Tensor)
            and t.dtype.is_floating_point]


def _fewer_nans(got, want) -> str:
    """The output's NaNs are among the reference's, and it equals the reference wherever both are not NaN."""
    g, w = got[0], want[0]
    if bool((g.isnan() & ~w.isnan()).any()):
        return "silent wrong result: NaN where the reference has none"
    both = ~g.isnan() & ~w.isnan()
    return "ok" if _differs((g[both],), (w[both],)) is None else "silent wrong result: values differ"


def _indexer_differs(got, want) -> str:
    from test_lightning_indexer import assert_same_topk
    try:
        if got[1].isnan().any() or want[1].isnan().any():
            problem = _differs((got[1],), (want[1],))
            return "ok" if problem is None else f"silent wrong result: {problem}"
        assert_same_topk(got, want, rtol=1e-4, atol=1e-3)
        return "ok"
    except AssertionError as e:
        return f"silent wrong result: {str(e)[:160]}"


def cases(every: int, ops: list[str] | None = None) -> list[tuple[int, int]]:
    """(spec index, spoil index) of every call (of the specs whose names start with one of `ops`), thinned to one
    in `every`."""
    gen = torch.Generator()
    found = []
    for i, spec in enumerate(SPECS):
        if ops is None or spec.name.startswith(tuple(ops)):
            found += [(i, j) for j in range(len(spoils(spec.make(gen.manual_seed(i)))))]
    return found[::every]


def worker(todo: list[tuple[int, int]]) -> None:
    """Runs the calls, printing START before and the verdict after each."""
    gen = torch.Generator()
    for i, j in todo:
        spec = SPECS[i]
        args = spec.make(gen.manual_seed(i))
        name, how, bad = spoils(args)[j]
        args = {**args, name: bad}
        print(f"START {i} {j}", flush=True)
        print(json.dumps({"case": [i, j], "op": spec.name, "argument": name, "spoiled": how,
                          "verdict": verdict(spec, name, how, args)}), flush=True)


def _run_path(path: str, todo: list[tuple[int, int]]) -> list[dict]:
    """Every call on one path (torch, or a native level), in workers: a call that crashes or hangs its worker is
    recorded as such and the next worker starts after it."""
    env = {**os.environ, native.ENV_SWITCH: "0" if path == "torch" else "1"}
    if path != "torch":
        env["ASCEND_DSA_CPU_ISA"] = path
    results: list[dict] = []
    while todo:
        command = [sys.executable, __file__, "--worker", json.dumps(todo)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
            out, ended = done.stdout, f"crash (exit {done.returncode})" if done.returncode else None
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
            ended = f"hang (no result in {TIMEOUT_S} s)"
        lines = out.splitlines()
        results += [{**json.loads(line), "path": path} for line in lines if line.startswith("{")]
        finished = sum(line.startswith("{") for line in lines)
        if ended is None and finished == len(todo):
            break
        started = [line for line in lines if line.startswith("START")]
        if ended is None or len(started) == finished:
            raise RuntimeError(f"the probe's worker stopped on its own: {out[-500:]}")
        results.append({"case": todo[finished], "op": SPECS[todo[finished][0]].name, "path": path,
                        "verdict": ended})
        todo = todo[finished + 1:]
    return results


def probe(every: int, paths: list[str], ops: list[str] | None = None) -> list[dict]:
    todo = cases(every, ops)
    return [result for path in paths for result in _run_path(path, todo)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=1, help="run one call in N (default: all)")
    parser.add_argument("--paths", default=None, help="comma-separated: torch and native levels (default: all)")
    parser.add_argument("--ops", default=None, help="comma-separated op names (default: all)")
    parser.add_argument("--json", action="store_true", help="every call's verdict as JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker([tuple(case) for case in json.loads(args.worker)])
    from npu_graph.kernels.native import cpu_isa
    paths = args.paths.split(",") if args.paths else ["torch", *cpu_isa.supported()]
    results = probe(args.every, paths, args.ops.split(",") if args.ops else None)
    bad = [r for r in results if r["verdict"] != "ok"]
    if args.json:
        print(json.dumps({"calls": len(results), "findings": bad}, indent=1))
    else:
        for r in bad:
            print(f"{r['path']:>12} {r['op']}: `{r.get('argument')}` {r.get('spoiled')}: {r['verdict']}")
        kinds = Counter(r["verdict"].split(":")[0] for r in bad)
        print(f"{len(results)} calls, {len(bad)} findings {dict(kinds)}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

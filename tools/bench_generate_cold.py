"""`ascend-dsa bench generate --cold`: first generate() with empty compile caches, and again with the caches it left.

Each compiled backend's first generate() runs in a fresh process whose compile caches are empty folders
(XDG_CACHE_HOME: ascend_dsa's compile cache and native libraries; TORCHINDUCTOR_CACHE_DIR: Inductor's FX graph,
AOT autograd and C++ caches), as on a newly installed machine: cold_first_generate_s. ascend_dsa's process then
waits for its background glue compiles (npu_graph.runtime.glue_upgrade) so that its cache holds what they gave:
glue_ready_s, counted from the end of that first generate(). A second process with the same folders measures
warm_first_generate_s. Processes run one after the other, never side by side.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from npu_graph.tools.bench_generate_cases import Case

COLD_BACKENDS = ("inductor", "ascend_dsa")


def _first_generate(case: Case, backend: str) -> dict[str, float]:
    """In the child: compile `case` with `backend`, time its first generate() (and the glue's landing)."""
    model = case.build()
    model.forward = torch.compile(model.forward, backend=backend)
    prompt = case.prompt()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=case.new_tokens, min_new_tokens=case.new_tokens, do_sample=False)
    first = time.perf_counter() - start
    figures = {"first_generate_s": first}
    if backend == "ascend_dsa":
        from npu_graph.runtime import glue_upgrade
        glue_upgrade.wait_all()
        figures["glue_ready_s"] = time.perf_counter() - start - first
    return figures


def _in_child(case: Case, backend: str, folder: str) -> dict[str, float]:
    env = {**os.environ, "XDG_CACHE_HOME": os.path.join(folder, "xdg"),
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor")}
    env.pop("ASCEND_DSA_CACHE_DIR", None)
    env.pop("ASCEND_DSA_NATIVE_DIR", None)
    spec = json.dumps({"case": case.__dict__, "backend": backend})
    done = subprocess.run([sys.executable, "-m", "npu_graph.tools.bench_generate_cold", spec], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the cold generate() of {case.label} with {backend} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_cold(case: Case, backends: tuple[str, ...] = COLD_BACKENDS) -> list[dict[str, Any]]:
    """One row per backend: cold and warm first generate() (and ascend_dsa's glue_ready_s); ratios to Inductor's
    cold call and to the backend's own cold call."""
    rows = []
    for backend in backends:
        with tempfile.TemporaryDirectory(prefix="ascend-dsa-cold-") as folder:
            cold = _in_child(case, backend, folder)
            warm = _in_child(case, backend, folder)
        rows.append({"case": case.label, "backend": backend, "cold_first_generate_s": cold["first_generate_s"],
                     "warm_first_generate_s": warm["first_generate_s"], "glue_ready_s": cold.get("glue_ready_s")})
    inductor = next((r["cold_first_generate_s"] for r in rows if r["backend"] == "inductor"), None)
    for row in rows:
        row["cold_vs_inductor_cold"] = row["cold_first_generate_s"] / inductor if inductor else None
        row["warm_vs_own_cold"] = row["warm_first_generate_s"] / row["cold_first_generate_s"]
    return rows


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    print(json.dumps(_first_generate(Case(**request["case"]), request["backend"])))

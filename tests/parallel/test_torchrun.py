"""torchrun, the tested way to launch: a user's script (torchrun_script.py) started by `python -m
torch.distributed.run` with c10d rendezvous, on one host (`--standalone`) and as two simulated nodes (two torchrun
invocations against one rendezvous endpoint on this host), gloo on CPU, the ranks sharing one compile cache.
Every rank's CP×TP DSA prefill, expert-parallel compiled model and compiled model under CP×TP×EP equals one
process's (relative max difference <= 1e-5), and the expert-parallel graphs are compiled once for all ranks. The
4-process runs take minutes on 2 cores: slow-marked."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import cp_workers
import pytest
import torch
import torchrun_script

from npu_graph.parallel.torchrun_copies import free_port, run_copies

SCRIPT = Path(__file__).with_name("torchrun_script.py")
TIMEOUT_S = 900


def torchrun(tmp_path: Path, workloads: str, nodes: int, nproc: int) -> list[dict]:
    """Run the script under torchrun: `nodes` invocations of `nproc` processes each; every rank's results."""
    out = tmp_path / "out"
    out.mkdir()
    where = ["--standalone"] if nodes == 1 else [
        "--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "--rdzv-id", "ascend-dsa-test"]
    command = [sys.executable, "-m", "torch.distributed.run", *where, "--nproc-per-node", str(nproc),
               "--max-restarts", "0", str(SCRIPT), str(out), workloads]
    env = dict(os.environ, ASCEND_DSA_CACHE_DIR=str(tmp_path / "cache"))
    logs = [tmp_path / f"node{node}.log" for node in range(nodes)]
    codes = run_copies(command, logs, env, TIMEOUT_S)
    assert codes == [0] * nodes, "\n".join(log.read_text()[-3000:] for log in logs)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(nodes * nproc)]


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def check_dsa(ranks: list[dict]) -> None:
    model, x = cp_workers.reference_model()
    with torch.no_grad():
        for n, layer in enumerate(cp_workers.DSA_LAYERS):
            cache = model.new_cache(x.shape[0])
            want = model.layers[layer].mixer(x, cache.positions(x.shape[1]), cache)
            for rank in ranks:
                assert rel(rank["dsa"][n], want) <= 1e-5, (rank["rank"], layer)


def check_model(ranks: list[dict], workload: str, prompt_of) -> None:
    model = torchrun_script.reference()
    with torch.no_grad():
        for rank in ranks:
            want = model(torchrun_script.tokens(prompt_of(rank["rank"])))
            assert rel(rank[workload], want) <= 1e-5, (workload, rank["rank"])


def check_all(ranks: list[dict]) -> None:
    tp = len(ranks) // 2
    check_dsa(ranks)
    check_model(ranks, "ep", lambda rank: rank)
    check_model(ranks, "mesh", lambda rank: rank // tp)


def test_expert_parallel_model_on_two_simulated_nodes_compiled_once(tmp_path):
    """The ranks' graphs differ only by each rank's place in the EP group: one of them compiles each graph."""
    ranks = torchrun(tmp_path, "ep", nodes=2, nproc=1)
    check_model(ranks, "ep", lambda rank: rank)
    decisions = [rank["cache"] for rank in ranks]
    assert all(sorted(graph) == ["hit", "miss"] for graph in zip(*decisions)), decisions


@pytest.mark.slow
def test_cp_tp_dsa_ep_and_compiled_mesh_on_one_host(tmp_path):
    check_all(torchrun(tmp_path, "dsa,ep,mesh", nodes=1, nproc=4))


@pytest.mark.slow
def test_cp_tp_dsa_ep_and_compiled_mesh_on_two_simulated_nodes(tmp_path):
    check_all(torchrun(tmp_path, "dsa,ep,mesh", nodes=2, nproc=2))

"""shard_experts on real processes (gloo): the sharded model's logits against the whole model's in the same
process, for the reference model (eager at EP=2: plain, every token routed to rank 0's experts, int8 dispatch)
and, slow-marked, compiled with ascend_dsa: the reference model at EP=2 and EP=4 and transformers'
Qwen3-MoE, DeepSeek-V3.2 and Kimi Linear at EP=2 (each rank compiles; ~1-2 min on two cores)."""
import ep_model_workers
import pytest
import torch

from npu_graph.parallel import launch
from npu_graph.parallel.ep_placement import rank_loads

HF_MODELS = ["qwen3_moe", "deepseek_v32", "kimi_linear"]


@pytest.fixture(scope="module")
def reference2() -> list[dict]:
    return launch(ep_model_workers.reference_checks, 2, args=(False,), timeout_s=180.0)


def _check_sharded(rank: int, world: int, result: dict, tol: float = 1e-5) -> None:
    assert result["rel"] < tol
    assert result["experts"] == pytest.approx(1 / world)       # routed expert weights: 1/EP per rank
    assert result["params"] < 0.95
    local = 8 // world
    assert result["layers"] and all(kept == range(rank * local, (rank + 1) * local) for _, kept in result["layers"])


def _check_summary(rank: int, world: int, result: dict) -> None:
    """summary.json lists every EP layer of the compiled graphs with this rank's experts."""
    local = 8 // world
    assert len(result["summary"]) == len(result["layers"])
    for layer in result["summary"]:
        assert (layer["ep_world_size"], layer["ep_rank"], layer["experts"]) == (world, rank, 8)
        assert layer["local_experts"] == [rank * local, (rank + 1) * local]
    for layer, (name, _) in zip(result["summary"], result["layers"]):
        assert layer["module"].startswith(name)


def test_reference_eager(reference2):
    for rank, result in enumerate(reference2):
        _check_sharded(rank, 2, result["eager"])
        assert all(result["eager"]["routed"][4:])                  # both ranks' experts are used


def test_reference_skewed_to_one_rank(reference2):
    for rank, result in enumerate(reference2):
        _check_sharded(rank, 2, result["skew"])
        routed = result["skew"]["routed"]
        assert sum(routed[:4]) > 0 and routed[4:] == [0, 0, 0, 0]


def test_reference_with_balanced_placement(reference2):
    """Routing skewed to experts 0-3 (contiguous: all on rank 0), experts placed by the observed loads instead:
    the same logits, each rank holds its placement's experts, and the rank loads are closer to even."""
    for rank, result in enumerate(reference2):
        placed = result["placed"]
        assert placed["rel"] < 1e-5
        for name, kept in placed["layers"]:
            assert list(kept) == placed["placement"][name][rank]
            loads = torch.tensor(placed["loads"][name])
            assert rank_loads(loads, placed["placement"][name]).max() < rank_loads(loads, [range(4), range(4, 8)]
                                                                                  ).max()


def test_reference_quantized_dispatch(reference2):
    for result in reference2:
        assert 0.999 <= result["quant"]["cosine"] < 1.0
        assert result["quant"]["rel"] < 0.05


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_reference_compiled(world):
    for rank, result in enumerate(launch(ep_model_workers.reference_checks, world, args=(True,), timeout_s=600.0)):
        _check_sharded(rank, world, result["compiled"])
        _check_summary(rank, world, result["compiled"])
        _check_sharded(rank, world, result["eager"])


@pytest.mark.slow
def test_transformers_compiled():
    results = launch(ep_model_workers.model_check, 2, args=(HF_MODELS, True), timeout_s=600.0)
    for rank, result in enumerate(results):
        for name in HF_MODELS:
            _check_sharded(rank, 2, result[name])
            _check_summary(rank, 2, result[name])

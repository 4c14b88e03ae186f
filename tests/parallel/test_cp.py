"""CP×TP on real processes (gloo on CPU) against one process: the CP lightning indexer, CP sparse attention,
the reference model's DSA layers under CP×TP, KDA sequence splitting (launch's own tests: test_launch.py).

One spawn of 4 ranks serves every check of cp=4 (tp=1) and cp=2 × tp=2; the cp=2, tp=1 world is slow-marked.
"""
import cp_workers
import pytest
import torch

from npu_graph.models.kda import kda_core
from npu_graph.parallel import (
    cp_lightning_indexer,
    init_cp_tp,
    kda_split,
    launch,
    zigzag_chunks,
)

LAYOUTS_4 = [(4, 1), (2, 2)]
TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return launch(cp_workers.run_checks, 4, args=(LAYOUTS_4,), timeout_s=TIMEOUT_S)


def _ranks(results: list[dict], layout: tuple[int, int]) -> list[dict]:
    return [r[layout] for r in results]


def check_indexer(results: list[dict], layout: tuple[int, int]) -> None:
    query, key, weights = cp_workers.indexer_inputs()
    indices, values = torch.ops.ascend_dsa.lightning_indexer(query, key, weights,
                                                             sparse_count=cp_workers.SPARSE_COUNT)
    assert (indices == -1).any() and (indices >= 0).any()
    for rank in _ranks(results, layout):
        got_indices, got_values = rank["indexer"]
        assert torch.equal(got_indices, indices)
        # A rank scores a few rows (the native per-row kernel), the whole run many (the batched torch path): the
        # same fp32 products summed in another order, within a few fp32 ulps of the scores' magnitude.
        torch.testing.assert_close(got_values, values, rtol=1e-5, atol=1e-5)


def check_attention(results: list[dict], layout: tuple[int, int]) -> None:
    inputs = cp_workers.attention_inputs()
    expected = torch.ops.ascend_dsa.sparse_flash_attention(
        inputs["query"], inputs["key"], inputs["key"], inputs["sparse_indices"], 0.125,
        query_rope=inputs["query_rope"], key_rope=inputs["key_rope"])
    for rank in _ranks(results, layout):
        for got, want in zip(rank["attention"], expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def check_dsa(results: list[dict], layout: tuple[int, int]) -> None:
    model, x = cp_workers.reference_model()
    with torch.no_grad():
        for n, i in enumerate(cp_workers.DSA_LAYERS):
            cache = model.new_cache(x.shape[0])
            expected = model.layers[i].mixer(x, cache.positions(x.shape[1]), cache)
            for rank in _ranks(results, layout):
                torch.testing.assert_close(rank["dsa"][n], expected, rtol=1e-4, atol=1e-5)


def check_kda(results: list[dict], layout: tuple[int, int]) -> None:
    inputs = cp_workers.kda_inputs()
    state = inputs.pop("initial_state")
    expected, final = torch.ops.ascend_dsa.chunk_kda(*inputs.values(), None, state, output_final_state=True)
    ranks = sorted((r for r in _ranks(results, layout) if r["tp_rank"] == 0), key=lambda r: r["cp_rank"])
    assert len(ranks) == layout[0]
    torch.testing.assert_close(torch.cat([r["kda"][0] for r in ranks], dim=1), expected, rtol=1e-4, atol=1e-5)
    for rank in _ranks(results, layout):
        torch.testing.assert_close(rank["kda"][1], final, rtol=1e-4, atol=1e-5)


CHECKS = [check_indexer, check_attention, check_dsa, check_kda]


@pytest.mark.parametrize("layout", LAYOUTS_4, ids=lambda layout: f"cp{layout[0]}_tp{layout[1]}")
@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_cp_matches_one_process(world4, check, layout):
    check(world4, layout)


def test_groups_layout_follows_rank_order(world4):
    assert [r["rank"] for r in world4] == [0, 1, 2, 3]
    assert [(r[(2, 2)]["cp_rank"], r[(2, 2)]["tp_rank"]) for r in world4] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert "the world has 4 ranks but cp·tp = 3·1 = 3" in world4[0]["layout_error"]


def test_kda_split_single_process_is_chunk_kda():
    inputs = cp_workers.kda_inputs()
    state = inputs.pop("initial_state")
    o, final = kda_core(*inputs.values(), scale=16 ** -0.5, initial_state=state, output_final_state=True)
    got, got_final = kda_split(*inputs.values(), None, initial_state=state, chunk_size=16)
    torch.testing.assert_close(got, o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_final, final, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return launch(cp_workers.run_checks, 2, args=([(2, 1)],), timeout_s=TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_cp2_matches_one_process(world2, check):
    check(world2, (2, 1))


def test_clear_errors_without_processes():
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"):
        init_cp_tp(2, 1)
    with pytest.raises(ValueError, match="its length is 7"):
        zigzag_chunks(2, 0, 7)
    query, key, weights = cp_workers.indexer_inputs()
    with pytest.raises(ValueError, match="local query slice has 64 tokens but the local key slice 32"):
        cp_lightning_indexer(query, key[:, :32], weights, None, sparse_count=4)
    inputs = cp_workers.kda_inputs()
    with pytest.raises(ValueError, match=r"initial_state has shape \(2, 16, 8\)"):
        kda_split(*list(inputs.values())[:5], None, initial_state=inputs["initial_state"][0])

"""moe_dispatch / moe_combine on 4 gloo ranks, as EP groups of 4 and of 2 (two groups of two), against one
process's fused_moe over all experts: uniform, decode-sized, skewed (every token on one rank's experts),
uneven token counts, int8-quantized and bf16 dispatch; the errors for bad input; and EP composed with CP×TP
(init_parallel layouts, a DeviceMesh) on the reference MoE block. One spawn serves all."""
import ep_mesh_workers
import ep_workers
import pytest

from npu_graph.parallel import DistributedLaunchError, launch

SIZES = [4, 2]
EXACT = ["uniform", "decode", "skew_first", "skew_last", "uneven"]
TOKENS = {"decode": 1}


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return launch(ep_workers.op_checks, 4, args=(SIZES,), timeout_s=180.0)


def _ranks(results: list[dict], size: int, case: str) -> list[dict]:
    """The results of case `case` on the ranks of one EP group of `size` (ranks 0..size-1)."""
    return [r["dispatch"][size, case] for r in results[:size]]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("case", EXACT)
def test_matches_one_process(world4, size, case):
    for rank in _ranks(world4, size, case):
        assert rank["rel"] < 1e-5
        assert rank["tail_zero"]


@pytest.mark.parametrize("size", SIZES)
def test_static_row_bound(world4, size):
    top_k, local = ep_workers.TOP_K, ep_workers.EXPERTS // size
    for case in ("uniform", "decode", "quant"):
        for rank in _ranks(world4, size, case):
            assert rank["rows"] == size * TOKENS.get(case, 12) * min(top_k, local)


@pytest.mark.parametrize("size", SIZES)
def test_skew_reaches_one_rank(world4, size):
    every = size * 12 * ep_workers.TOP_K
    first = [rank["received"] for rank in _ranks(world4, size, "skew_first")]
    last = [rank["received"] for rank in _ranks(world4, size, "skew_last")]
    assert first == [every] + [0] * (size - 1)
    assert last == [0] * (size - 1) + [every]
    uneven = [rank["received"] for rank in _ranks(world4, size, "uneven")]
    assert uneven[0] == sum(3 + 4 * r for r in range(size)) * ep_workers.TOP_K


@pytest.mark.parametrize("size", SIZES)
def test_uniform_routing_spreads(world4, size):
    received = [rank["received"] for rank in _ranks(world4, size, "uniform")]
    assert sum(received) == size * 12 * ep_workers.TOP_K
    assert all(n > 0 for n in received)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("case", ["quant", "quant_skew"])
def test_quantized_dispatch_cosine(world4, size, case):
    for rank in _ranks(world4, size, case):
        assert 0.999 <= rank["cosine"] < 1.0      # close, but not the unquantized result
        assert rank["rel"] < 0.05


@pytest.mark.parametrize("size", SIZES)
def test_bf16(world4, size):
    for rank in _ranks(world4, size, "bf16"):
        assert str(rank["dtype"]) == "torch.bfloat16"
        assert rank["rel"] < 2e-2


ERRORS = {
    "indivisible": "6 routed experts, which do not split evenly over an EP group of 4",
    "mismatched_models": "every rank of the EP group must pass the same model",
    "wrong_ep_size": "has 4 ranks but ep_world_size=2",
    "wrong_ep_rank": "the model was sharded for another rank",
    "ids_out_of_range": "`expert_ids` must lie in [0, 8)",
    "not_a_group": "must be a torch.distributed ProcessGroup, a DeviceMesh or ParallelGroups",
    "no_moe": "has no MoE block",
    "twice": "is already expert-parallel",
    "one_rank_bad_ids": "`expert_ids` must lie in [0, 8); EP ranks [1] passed ids that are not",
    "repeated_ids": "the k expert ids of a token must be distinct (as npu_moe_distribute_dispatch requires); EP "
                    "ranks [0]",
    "uneven_without_global_bs": "the EP ranks have different token counts [4, 5, 6, 7] and global_bs=0, which "
                                "needs equal counts; pass global_bs >= ep_world_size · the largest count = 28",
    "global_bs_too_small": "global_bs=15 is below ep_world_size · the largest token count of the group = 4·4 = 16",
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors(world4, case):
    for rank in world4:
        assert ERRORS[case] in rank["errors"][case]
        assert rank["errors"].get(case + "_s", 0) < 20       # from the first collective, not a peer's timeout


@pytest.mark.parametrize("layout", ep_mesh_workers.LAYOUTS_4, ids=str)
def test_ep_over_mesh_dimensions(world4, layout):
    ep_mesh_workers.check_layout([rank["mesh"] for rank in world4], layout)


def test_ep_over_a_whole_device_mesh(world4):
    for rank in world4:
        mesh = rank["mesh"]
        assert mesh["device_mesh"]["rel"] < 1e-5 and mesh["device_mesh"]["ep"] == 4
        assert mesh["device_mesh"]["sent"] == [5]
        assert "ep_dims=('ep',) must name distinct dimensions among ('dp', 'cp', 'tp')" in mesh["bad_dims"]


def test_not_a_member(world4):
    for rank in world4[2:]:
        assert "is not a member of the EP group" in rank["errors"]["not_a_member"]


@pytest.mark.slow
def test_rank_dying_in_dispatch_is_named():
    with pytest.raises(DistributedLaunchError, match="rank 1 died"):
        launch(ep_workers.die_in_dispatch, 2, timeout_s=60.0)

"""Expert placement from observed loads (no second process): balanced packing against contiguous blocks on skewed
loads, the placement checks, the logical -> physical slot map, and load recording on the reference model (the
distributed run with a placement is in test_ep_models.py)."""
import pytest
import torch

from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.parallel.ep_placement import (
    balanced_placement,
    check_placement,
    contiguous_placement,
    physical_slots,
    rank_loads,
    record_expert_loads,
)


def test_balanced_packing_beats_contiguous_blocks_on_skew():
    loads = torch.tensor([8, 7, 6, 5, 1, 1, 1, 1.0])
    placement = balanced_placement(loads, 2)
    assert placement == [[0, 3, 4, 6], [1, 2, 5, 7]]
    assert rank_loads(loads, placement).tolist() == [15, 15]
    assert rank_loads(loads, contiguous_placement(8, 2)).tolist() == [26, 4]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zipf_loads(world):
    g = torch.Generator().manual_seed(0)
    popularity = 1.0 / torch.arange(1, 65, dtype=torch.float64) ** 1.2
    loads = torch.bincount(torch.multinomial(popularity[torch.randperm(64, generator=g)], 8000, replacement=True,
                                             generator=g), minlength=64)
    placement = balanced_placement(loads, world)
    assert sorted(e for held in placement for e in held) == list(range(64))
    assert {len(held) for held in placement} == {64 // world}
    balanced, contiguous = rank_loads(loads, placement), rank_loads(loads, contiguous_placement(64, world))
    assert balanced.max() < contiguous.max()
    # no placement does better than the mean, or than the hottest expert plus the lightest L-1 beside it
    # (splitting one expert needs replicas, which EPLB adds and this does not)
    local = 64 // world
    bound = max(loads.sum().item() / world, loads.max().item() + loads.sort().values[:local - 1].sum().item())
    assert balanced.max() <= 1.01 * bound


def test_check_placement_and_slots():
    assert check_placement(([3, 1], (0, 2)), 4, 2, "mlp") == [[3, 1], [0, 2]]
    for bad in ([[0, 1], [1, 2]], [[0, 1, 2], [3]], [[0, 1]]):
        with pytest.raises(ValueError, match="for each of the 2 EP ranks, 2 experts, every one of the 4 exactly once"):
            check_placement(bad, 4, 2, "mlp")
    slots = physical_slots([[3, 1], [0, 2]])
    assert slots.tolist() == [2, 1, 3, 0]          # expert 3 -> rank 0's slot 0, expert 0 -> rank 1's slot 0
    with pytest.raises(ValueError, match="8 experts do not split evenly over 3 ranks"):
        balanced_placement(torch.ones(8), 3)


def test_record_expert_loads_on_the_reference_model():
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named("tiny")).eval()
    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), record_expert_loads(model) as loads:
        model(ids)
        model(ids)
    moe_blocks = [name for name, m in model.named_modules() if type(m).__name__ == "DeepSeekMoE"]
    assert sorted(loads) == sorted(moe_blocks) and moe_blocks
    for load in loads.values():
        assert load.shape == (8,) and int(load.sum()) == 2 * 24 * model.config.num_experts_per_tok
    with torch.no_grad():
        model(ids)
    assert all(int(load.sum()) == 96 for load in loads.values())     # the hooks are gone after the block

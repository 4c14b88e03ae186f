"""Graphs that differ across ranks only by their process groups' names and the rank's own position in them
(npu_graph.parallel.rank_free) key, compile and load one cache entry: the second rank hits what the first
compiled (the entry's lease elects one compiler), and computes its own result with it."""
import rank_free_workers
import torch

from npu_graph.parallel import launch, rank_free


def test_ranks_share_one_entry_and_each_computes_its_own(tmp_path):
    ranks = launch(rank_free_workers.compile_together, 2, args=(str(tmp_path / "cache"),), timeout_s=300)
    assert sorted(r["cache"] for r in ranks) == ["hit", "miss"], ranks
    for rank, result in enumerate(ranks):
        assert result["fallback"] is None and result["rel"] <= 1e-6, result
        assert result["aliases"] == ["ascend_dsa:2:1", "ascend_dsa:2:1#2"]
        (layer,) = result["ep"]
        assert (layer["group"], layer["ep_rank"], layer["local_experts"]) == (
            "ascend_dsa:2:1", rank, [4 * rank, 4 * rank + 4])


def test_outside_a_distributed_run_nothing_changes():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert rank_free.make_rank_free(gm) == 0

"""tools/trained_accuracy: the accuracy object's measures on runs built by hand, and the compiled runs on a
tiny random model (slow)."""
import math

import pytest
import torch

from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.tools.trained_accuracy import HeldoutRun, as_text, compare, run_policy


def _run(logits, picks, continuations):
    return HeldoutRun(logits, [picks], continuations)


def test_identical_runs_score_perfectly_and_differences_are_counted():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 256)
    targets = torch.randint(0, 256, (2, 5))
    picks = torch.tensor([[[0, 1, 2, -1]]])
    same = compare(_run(logits, picks, torch.zeros(2, 3)), _run(logits, picks, torch.zeros(2, 3)), targets)
    assert same["perplexity_increase"] == 0 and same["top1_agreement"] == 1 and same["indexer_recall"] == 1
    assert same["logits_cosine_mean"] == pytest.approx(1) and same["greedy_identical_prompts"] == same["prompts"] == 2
    shifted = logits.clone()
    shifted[0, 0] = -logits[0, 0]
    other = compare(_run(logits, picks, torch.zeros(2, 3)),
                    _run(shifted, torch.tensor([[[0, 5, 6, 7]]]), torch.tensor([[0, 0, 0], [0, 1, 0]])), targets)
    assert other["top1_agreement"] == pytest.approx(9 / 10) and other["indexer_recall"] == pytest.approx(1 / 3)
    assert other["greedy_identical_prompts"] == 1 and other["logits_cosine_min"] == pytest.approx(-1)
    assert math.isfinite(other["perplexity_increase"])


def test_bytes_read_as_text():
    assert as_text(torch.tensor([100, 101, 102, 10, 255])) == "def\n\ufffd"


@pytest.mark.slow   # two compiles of the tiny model
def test_compiled_runs_of_one_policy_agree_exactly():
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named("tiny")).eval()
    windows = torch.randint(0, 256, (2, 41))
    runs = [run_policy(model, windows, {"quant": "none"}, torch.float32, steps=3) for _ in range(2)]
    result = compare(*runs, windows[:, 1:])
    assert result["top1_agreement"] == 1 and result["greedy_identical_prompts"] == 2
    assert len(runs[0].indexer) == model.config.layer_types.count("dsa") and runs[0].continuations.shape == (2, 3)

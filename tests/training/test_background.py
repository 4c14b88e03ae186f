"""The demo's checkpoint trained in a child process while the demo compiles: the weights land in the model the
demo compiled, in place, and a failed training is a clear error."""
import pytest
import torch

from npu_graph.models import checkpoint
from npu_graph.models.hybrid import HybridLM
from npu_graph.training import background


@pytest.mark.slow
def test_background_training_fills_the_compiled_model_in_place(tmp_path, monkeypatch):
    monkeypatch.setenv("ASCEND_DSA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(background, "QUICK_MINUTES", 0.02)
    model, training = background.quick_model("stdlib")
    assert training is not None
    params = dict(model.named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}
    with training:
        assert training.load_into(model) is model
    trained = HybridLM.from_pretrained(training.out)
    for name, p in model.named_parameters():
        assert p is params[name]                                  # the same objects: compiled graphs stay valid
        assert torch.equal(p, dict(trained.named_parameters())[name])
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    again, none = background.quick_model("stdlib")                # now the checkpoint exists: no training
    assert none is None and torch.equal(next(again.parameters()), next(trained.parameters()))


def test_failed_background_training_is_a_clear_error(tmp_path):
    failed = r"training the quick checkpoint failed .*ascend-dsa train"
    with background.BackgroundTraining("no-such-config", 0, tmp_path / "out", minutes=0.01) as training, \
            pytest.raises(checkpoint.CheckpointError, match=failed):
        training.load_into(None)


def test_leaving_early_stops_the_training(tmp_path):
    with background.BackgroundTraining("stdlib", 0, tmp_path / "out", minutes=5) as training:
        pass
    assert training.process.returncode is not None and not (tmp_path / "out").exists()

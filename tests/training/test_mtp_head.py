"""Training the MTP head on a frozen model (npu_graph.training.mtp_head): the head's held-out loss falls, the main
weights stay as they were, and the saved checkpoint loads as a model with mtp_layers=1."""
import torch

from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.training import corpus, mtp_head
from npu_graph.training.mtp_head import mtp_loss, train_mtp_head, with_mtp_head

SEQ_LEN = 48


def test_short_run_trains_only_the_head_and_saves_it(tmp_path, monkeypatch):
    monkeypatch.setattr(mtp_head, "SEQ_LEN", SEQ_LEN)
    monkeypatch.setattr(mtp_head, "BATCH", 4)
    torch.manual_seed(0)
    base = HybridLM(HybridConfig.named("tiny")).eval()
    model = with_mtp_head(base)
    assert model.config.mtp_layers == 1 and not base.config.mtp_layers
    heldout = corpus.fixed_windows(corpus.load_corpus(max_train_bytes=1).heldout, 8, SEQ_LEN)
    with torch.no_grad():
        before, _ = mtp_loss(model, heldout)
    record = train_mtp_head(model, 1.0, tmp_path / "mtp", max_steps=40, max_train_bytes=100_000)
    with torch.no_grad():
        after, _ = mtp_loss(model, heldout)
    assert record["steps"] == 40 and after < before - 0.3
    for name, weight in base.state_dict().items():
        assert torch.equal(model.state_dict()[name], weight), name
    loaded = HybridLM.from_pretrained(tmp_path / "mtp")
    assert loaded.config.mtp_layers == 1
    assert all(torch.equal(loaded.state_dict()[n], w) for n, w in model.state_dict().items())

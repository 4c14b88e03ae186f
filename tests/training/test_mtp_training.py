"""The MTP head trained with the model (config "stdlib-mtp"): its loss is reported beside the main loss, its
gradient reaches the main model (DeepSeek-V3), it learns, and the checkpoint keeps it; a config without a head
trains as before."""
import contextlib
import io
import json

import pytest
import safetensors.torch
import torch

from npu_graph.models import checkpoint
from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.training import corpus
from npu_graph.training.loop import TrainSettings, heldout_scores, train
from npu_graph.training.progress import StepReporter

SHORT = dict(config="stdlib-mtp", batch=2, seq_len=48, eval_windows=4, eval_every=1000, max_train_bytes=100_000,
             warmup_steps=2)


def weights(path):
    return safetensors.torch.load_file(str(path / checkpoint.WEIGHTS))


def test_mtp_loss_is_reported_trained_and_saved(tmp_path):
    record = train(TrainSettings(max_steps=10, lr=1e-2, **SHORT), out=tmp_path / "ck", show_progress=False)
    assert set(record["final_losses"]) == {"bits_per_byte", "mtp_bits_per_byte", "indexer_kl", "balance"}
    assert record["heldout_mtp_bits_per_byte"] < 7.0 and 0 <= record["heldout_mtp_top1"] <= 1     # uniform: 8
    model = HybridLM.from_pretrained(tmp_path / "ck")
    assert model.config.mtp_layers == 1
    heldout = corpus.fixed_windows(corpus.load_corpus(max_train_bytes=1).heldout, 4, 48)
    scores = heldout_scores(model, heldout, 2)
    assert scores["mtp_bits_per_byte"] == pytest.approx(record["heldout_mtp_bits_per_byte"], abs=1e-4)
    torch.manual_seed(0)
    untrained = heldout_scores(HybridLM(HybridConfig.named("stdlib-mtp")), heldout, 2)
    assert scores["mtp_bits_per_byte"] < untrained["mtp_bits_per_byte"] - 0.5


def test_mtp_gradient_reaches_the_main_model(tmp_path):
    """Same seed and batches: with weight 0 the head's loss changes nothing but the head's own weights (only its
    indexer's KL, which needs no MTP loss, moves them); with weight 0.3 the main model's weights differ too."""
    for weight in (0.0, 0.3):
        train(TrainSettings(max_steps=2, mtp_weight=weight, **SHORT), out=tmp_path / str(weight), show_progress=False)
    without, with_mtp = weights(tmp_path / "0.0"), weights(tmp_path / "0.3")
    main = [name for name in without if not name.startswith("mtp.")]
    assert {"embed.weight", "lm_head.weight"} <= set(main)
    assert not torch.equal(without["lm_head.weight"], with_mtp["lm_head.weight"])
    assert not torch.equal(without["layers.0.mixer.q_a.weight"], with_mtp["layers.0.mixer.q_a.weight"])
    assert not torch.equal(without["mtp.eh_proj.weight"], with_mtp["mtp.eh_proj.weight"])


def test_a_config_without_a_head_reports_no_mtp_loss():
    scores = heldout_scores(HybridLM(HybridConfig.named("stdlib")), torch.randint(0, 256, (2, 17)), 2)
    assert set(scores) == {"bits_per_byte"}


def test_progress_line_shows_the_mtp_loss_beside_the_main_loss(monkeypatch):
    lines = io.StringIO()
    monkeypatch.setattr("npu_graph.training.progress.LINE_EVERY_S", 0.0)
    with contextlib.redirect_stderr(lines), StepReporter(None, 60.0) as reporter:
        reporter.update(7, {"bits_per_byte": 3.25, "mtp_bits_per_byte": 4.5}, 512)
    assert "step 7  3.250 bits/byte  (MTP 4.500)" in lines.getvalue()


def test_train_command_trains_the_head_and_rejects_a_negative_weight(tmp_path):
    from npu_graph.tools import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["train", "--config", "stdlib-mtp", "--steps", "1", "--batch", "2", "--seq-len", "32",
                         "--out", str(tmp_path / "ck")])
    assert code == 0 and "MTP head:" in out.getvalue() and "top-1" in out.getvalue()
    assert json.loads((tmp_path / "ck" / checkpoint.CONFIG).read_text())["mtp_layers"] == 1
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert cli.main(["train", "--config", "stdlib-mtp", "--mtp-weight", "-1"]) == 2
    assert "--mtp-weight must be >= 0" in err.getvalue()

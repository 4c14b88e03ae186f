"""npu_graph.training: the fixed split never leaks held-out files, a short run lowers the loss and is
reproducible for its seed, checkpoints round-trip bit-exactly and a damaged one is a clear error."""
import json

import pytest
import safetensors.torch
import torch

from npu_graph.models import checkpoint
from npu_graph.models.hybrid import HybridConfig, HybridLM, aux_losses
from npu_graph.training import corpus
from npu_graph.training.loop import TrainSettings, bits_per_byte, train

SHORT = dict(batch=2, seq_len=64, eval_windows=4, eval_every=1000, max_train_bytes=150_000, warmup_steps=2)


def test_split_is_fixed_and_never_leaks(tmp_path):
    for name in ("a.py", "pkg/b.py", "pkg/sub/c.py", "site-packages/x/d.py", "e.txt"):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}\nprint({name!r})\n")
    files = corpus.source_files(tmp_path)
    assert files == ["a.py", "pkg/b.py", "pkg/sub/c.py"]           # no site-packages, no other files
    real = corpus.source_files()
    held = {f for f in real if corpus.is_heldout(f)}
    assert 0.02 < len(held) / len(real) < 0.09                      # ~HELDOUT_PERCENT
    text = corpus.load_corpus(max_train_bytes=100_000)
    assert set(text.heldout_files) == held and not held & set(text.train_files)
    heldout_bytes = {(corpus.stdlib_root() / f).read_bytes() for f in text.heldout_files}
    train_docs = set(bytes(text.train.numpy()).split(corpus.SEPARATOR))
    assert not heldout_bytes & train_docs


def test_short_run_lowers_the_loss_and_saves_a_checkpoint(tmp_path):
    record = train(TrainSettings(max_steps=12, lr=1e-2, **SHORT), out=tmp_path / "ck", show_progress=False)
    first, last = record["heldout_curve"][0][1], record["heldout_bits_per_byte"]
    assert record["steps"] == 12 and last < 7.0, record       # uniform bytes are 8 bits
    assert (tmp_path / "ck" / "loss.svg").read_text().startswith("<svg")
    saved = checkpoint.load_record(tmp_path / "ck")
    assert saved["corpus_digest"] and saved["settings"]["seed"] == 0
    assert first == pytest.approx(last, abs=1e-4)
    assert set(saved["final_losses"]) == {"bits_per_byte", "indexer_kl", "balance"}


def test_training_is_reproducible_for_a_seed(tmp_path):
    runs = [train(TrainSettings(max_steps=3, **SHORT), out=tmp_path / f"run{i}", show_progress=False)
            for i in range(2)]
    weights = [safetensors.torch.load_file(str(tmp_path / f"run{i}" / checkpoint.WEIGHTS)) for i in range(2)]
    assert runs[0]["heldout_bits_per_byte"] == runs[1]["heldout_bits_per_byte"]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_checkpoint_round_trips_bit_exactly(tmp_path):
    torch.manual_seed(3)
    model = HybridLM(HybridConfig.named("stdlib")).eval()
    checkpoint.save(model, {"steps": 0}, tmp_path / "ck")
    loaded = HybridLM.from_pretrained(tmp_path / "ck")
    assert not loaded.training
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    windows = torch.randint(0, 256, (2, 33))
    assert bits_per_byte(model, windows, 2) == bits_per_byte(loaded, windows, 2)


@pytest.mark.parametrize("damage", ["missing folder", "no weights", "truncated weights", "bad config",
                                    "wrong shapes"])
def test_damaged_checkpoint_is_a_clear_error(tmp_path, damage):
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named("tiny"))
    path = checkpoint.save(model, {}, tmp_path / "ck")
    if damage == "missing folder":
        path = tmp_path / "nothing"
    elif damage == "no weights":
        (path / checkpoint.WEIGHTS).unlink()
    elif damage == "truncated weights":
        data = (path / checkpoint.WEIGHTS).read_bytes()
        (path / checkpoint.WEIGHTS).write_bytes(data[:len(data) // 2])
    elif damage == "bad config":
        (path / checkpoint.CONFIG).write_text("{not json")
    else:
        config = json.loads((path / checkpoint.CONFIG).read_text())
        config["hidden_size"] *= 2
        (path / checkpoint.CONFIG).write_text(json.dumps(config))
    with pytest.raises(checkpoint.CheckpointError, match=r"train"):
        HybridLM.from_pretrained(path)


def test_aux_losses_only_in_training_mode():
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named("tiny")).train()
    ids = torch.randint(0, 256, (2, 20))
    model(ids)
    losses = aux_losses(model)
    assert set(losses) == {"indexer_kl", "balance"} and losses["indexer_kl"] >= 0 and losses["balance"] > 0
    losses["indexer_kl"].backward()
    indexer = model.layers[0].mixer.indexer
    assert indexer.wk.weight.grad is not None and model.layers[0].mixer.q_a.weight.grad is None
    assert aux_losses(model.eval()) == {}


def test_train_command_writes_a_checkpoint_and_json(tmp_path):
    import contextlib
    import io

    from npu_graph.tools import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["train", "--steps", "1", "--out", str(tmp_path / "ck"), "--json"])
    record = json.loads(out.getvalue())
    assert code == 0 and record["steps"] == 1 and record["path"] == str(tmp_path / "ck")
    assert {"heldout_bits_per_byte", "seconds", "corpus_digest"} <= set(record)
    assert HybridLM.from_pretrained(record["path"]).config.vocab_size == 256

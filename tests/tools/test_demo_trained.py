"""`ascend-dsa demo` on the trained checkpoint: held-out prompts continued as text, eager vs compiled vs
quant="dsa", using the checkpoint in the cache directory (here a two-step one made by the test)."""
import contextlib
import io
import json

import pytest

from npu_graph.tools import cli
from npu_graph.training.loop import TrainSettings, default_dir, train


@pytest.mark.slow
def test_demo_continues_heldout_prompts_with_the_trained_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("ASCEND_DSA_CACHE_DIR", str(tmp_path / "cache"))
    train(TrainSettings(max_steps=2, batch=2, seq_len=64, eval_windows=2, max_train_bytes=100_000),
          out=default_dir("stdlib", 0), show_progress=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["demo", "--prompt-len", "96", "--steps", "2", "--json", "--no-cache",
                         "--dump-dir", str(tmp_path / "dump")])
    results = json.loads(out.getvalue())
    assert code == 0 and results["greedy_tokens_equal"]
    texts = results["text"]
    assert len(texts) == 3 and all(set(t) == {"prompt", "eager", "ascend_dsa", "ascend_dsa quant=dsa"}
                                   for t in texts)
    assert all(t["eager"] == t["ascend_dsa"] for t in texts)


def test_demo_refuses_a_prompt_longer_than_the_trained_context(capsys):
    assert cli.main(["demo", "--prompt-len", "600"]) == 2
    assert "exceeds the 'stdlib' model's context of 512 tokens" in capsys.readouterr().err

"""npu_graph.progress: a plain line on a pipe, nothing when switched off; stdout never touched."""
from npu_graph import progress


def test_status_prints_one_plain_line_on_a_pipe(capsys, monkeypatch):
    monkeypatch.delenv(progress.ENV_SWITCH, raising=False)
    with progress.status("building native kernel x (avx2)"):
        pass
    out, err = capsys.readouterr()
    assert out == "" and err == "ascend-dsa: building native kernel x (avx2)\n"


def test_status_is_silent_when_switched_off(capsys, monkeypatch):
    monkeypatch.setenv(progress.ENV_SWITCH, "0")
    with progress.status("anything"):
        pass
    assert capsys.readouterr() == ("", "")

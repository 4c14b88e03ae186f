"""The torchrun guide (docs/parallelism.md, "Distributed") as a user runs it: its script under its CPU torchrun
commands, one host and two simulated nodes (the second command twice, against one rendezvous endpoint on this host)."""
import os
import re
import sys
from pathlib import Path

import pytest

from npu_graph.parallel.torchrun_copies import free_port, run_copies

GUIDE = Path(__file__).parents[1] / "docs" / "parallelism.md"


def section() -> tuple[str, list[str]]:
    """The section's script and its CPU commands."""
    text = GUIDE.read_text()
    body = text[text.index("## Distributed (`torchrun`)"):]
    body = body[:body.index("\n## ", 1)]
    script = re.search(r"```python\n(.*?)```", body, re.S).group(1)
    commands = re.search(r"```bash\n(.*?)```", body, re.S).group(1).strip().splitlines()
    return script, commands


def run_command(tmp_path: Path, command: str, copies: int) -> list[str]:
    """`command` (torchrun as `python -m torch.distributed.run`, HOST0:29400 a free local port) started `copies`
    times at once in tmp_path; the lines the ranks printed."""
    words = command.replace("HOST0:29400", f"127.0.0.1:{free_port()}").split()
    assert words[0] == "torchrun"
    argv = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    env = dict(os.environ, ASCEND_DSA_CACHE_DIR=str(tmp_path / "cache"))
    logs = [tmp_path / f"node{i}.log" for i in range(copies)]
    codes = run_copies(argv, logs, env, 900, cwd=tmp_path)
    output = "".join(log.read_text() for log in logs)
    assert codes == [0] * copies, output[-3000:]
    return re.findall(r"rank \d+: logits \(1, 24, \d+\)", output)


def test_the_section_names_its_commands():
    script, commands = section()
    assert "init_process_group(\"gloo\")" in script and len(commands) == 2


def test_one_host(tmp_path):
    script, commands = section()
    (tmp_path / "run_ep.py").write_text(script)
    assert len(run_command(tmp_path, commands[0], 1)) == 2


@pytest.mark.slow
def test_two_simulated_nodes(tmp_path):
    script, commands = section()
    (tmp_path / "run_ep.py").write_text(script)
    assert len(run_command(tmp_path, commands[1], 2)) == 4

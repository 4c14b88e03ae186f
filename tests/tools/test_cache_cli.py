"""`ascend-dsa cache ...`: every command on clean, cluttered, damaged, missing and untrusted caches; messages
and exit codes instead of tracebacks; read-only commands create nothing."""
import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

from npu_graph.cache.disk_store import DiskCache
from npu_graph.cache.entry import Artifact
from npu_graph.cache.key import versions
from npu_graph.tools import cli
from npu_graph.tools.units import format_size, parse_size


@pytest.fixture(autouse=True)
def own_key(tmp_path, monkeypatch):
    monkeypatch.setenv("ASCEND_DSA_KEY_FILE", str(tmp_path / "keys" / "cache.key"))
    return tmp_path / "keys" / "cache.key"


def fill(root, count: int = 2) -> list[str]:
    """Store `count` small entries (no compiling needed: the commands only read what is stored)."""
    disk = DiskCache(str(root))
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(count)]
    for i, key in enumerate(keys):
        artifact = Artifact(f"def forward(self, x):\n    return [x + {i}]\n", [], {}, [], [], {},
                            {"nodes_after": 3, "fused_ops": {"rms_norm": 1}})
        assert disk.store(key, artifact, {"versions": versions(), "config": {}, "inputs": 1})
    return keys


def run_cli(*args):
    """(exit code, stdout, stderr) of `ascend-dsa cache ARGS` run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["cache", *args])
    return code, out.getvalue(), err.getvalue()


def as_json(*args):
    code, out, _ = run_cli(*args, "--json")
    return code, json.loads(out)


def tree(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(top, name), root)
                  for top, dirs, files in os.walk(root) for name in dirs + files)


def test_cache_command_runs_as_module(tmp_path):
    p = subprocess.run([sys.executable, "-m", "npu_graph", "cache", "stats", "--dir", str(tmp_path / "c"), "--json"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "there is no cache at" in p.stderr and "Traceback" not in p.stderr
    (tmp_path / "c").mkdir(mode=0o700)
    p = subprocess.run([sys.executable, "-m", "npu_graph", "cache", "stats", "--dir", str(tmp_path / "c"), "--json"],
                       capture_output=True, text=True)
    assert p.returncode == 0 and json.loads(p.stdout)["entries"] == 0 and os.listdir(tmp_path / "c") == []


READ_ONLY_COMMANDS = [["ls"], ["stats"], ["show", "ab"], ["verify"], ["prune"], ["clear"], ["export", "out.tgz"]]


@pytest.mark.parametrize("command", READ_ONLY_COMMANDS, ids=lambda c: c[0])
def test_a_missing_dir_is_an_error_and_is_not_created(tmp_path, own_key, command):
    code, out, err = run_cli(*command, "--dir", str(tmp_path / "nowhere"), "--json")
    assert code == 2 and f"there is no cache at {tmp_path / 'nowhere'}" in err
    assert json.loads(out) == {"error": f"there is no cache at {tmp_path / 'nowhere'}"}
    assert not (tmp_path / "nowhere").exists() and not own_key.exists()


def test_stray_files_are_ignored_by_every_command(tmp_path):
    keys = fill(tmp_path / "c")
    entries = tmp_path / "c" / "v2" / "entries"
    (entries / ".DS_Store").write_bytes(b"\0")
    where = ("--dir", str(tmp_path / "c"))
    code, listing = as_json("ls", *where)
    assert code == 0 and sorted(r["key"] for r in listing) == keys and all(r["ok"] for r in listing)
    assert as_json("stats", *where)[1]["entries"] == 2
    assert as_json("show", keys[0][:8], *where)[1]["graph"]["nodes_after"] == 3
    assert as_json("verify", *where) == (0, {"ok": 2, "quarantined": [], "ignored": [".DS_Store"]})
    assert as_json("export", str(tmp_path / "a.tgz"), *where)[1]["entries"] == 2
    assert as_json("import", str(tmp_path / "a.tgz"), "--dir", str(tmp_path / "d"))[1]["imported"] == 2
    assert as_json("prune", "--max-size", "1G", *where) == (0, {"removed": [], "left": {}})
    assert as_json("clear", *where) == (0, {"removed": 3, "left": {}})
    assert os.listdir(entries) == []
    code, out, err = run_cli("ls", *where)
    assert code == 0 and "ascend_dsa compile cache" in out and not err


def test_damaged_entries_are_reported_with_an_exit_code(tmp_path):
    keys = fill(tmp_path / "c")
    where = ("--dir", str(tmp_path / "c"))
    with open(os.path.join(DiskCache(str(tmp_path / "c")).entry_dir(keys[1]), "compiled.py"), "a") as f:
        f.write("# edited\n")
    rows = {r["key"]: r for r in as_json("ls", *where)[1]}
    assert rows[keys[0]]["ok"] and "does not match its hash" in rows[keys[1]]["problem"]
    code, out, err = run_cli("show", keys[1][:8], *where, "--json")
    assert code == 1 and not json.loads(out)["ok"] and "is damaged: compiled.py does not match its hash" in err
    code, out, err = run_cli("export", str(tmp_path / "a.tgz"), *where, "--json")
    assert code == 1 and json.loads(out)["entries"] == 1 and "1 entries that do not verify were left out" in err
    code, result = as_json("verify", *where)
    assert code == 1 and [(q["key"], q["quarantined"]) for q in result["quarantined"]] == [(keys[1], True)]
    assert as_json("verify", *where) == (0, {"ok": 1, "quarantined": [], "ignored": []})


def test_show_needs_one_matching_entry(tmp_path):
    fill(tmp_path / "c")
    code, _, err = run_cli("show", "zz", "--dir", str(tmp_path / "c"))
    assert code == 2 and f"no entry matches 'zz' in {tmp_path / 'c'}" in err and "cache ls" in err
    code, _, err = run_cli("show", "", "--dir", str(tmp_path / "c"))
    assert code == 2 and "2 entries match" in err


def test_clear_counts_what_it_removed_and_names_what_it_could_not(tmp_path, monkeypatch):
    keys = fill(tmp_path / "c", 3)
    disk = DiskCache(str(tmp_path / "c"))
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, disk.entry_dir("cd" * 32))
    real_rmtree = shutil.rmtree

    def stuck(path, *args, **kwargs):
        if os.path.basename(path) == keys[0]:
            raise PermissionError(13, "Permission denied")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", stuck)
    code, result = as_json("clear", "--dir", str(tmp_path / "c"))
    monkeypatch.undo()
    assert code == 1 and result["removed"] == 3 and list(result["left"]) == [keys[0]]
    assert "Permission denied" in result["left"][keys[0]]
    assert outside.exists() and DiskCache(str(tmp_path / "c")).entry_keys() == [keys[0]]


def test_read_only_commands_make_no_key_and_verify_needs_one(tmp_path, own_key):
    fill(tmp_path / "c")
    os.unlink(own_key)
    before = tree(tmp_path / "c")
    for command in (["ls"], ["stats"], ["show", ""], ["export", str(tmp_path / "a.tgz")]):
        run_cli(*command, "--dir", str(tmp_path / "c"))
    rows = as_json("ls", "--dir", str(tmp_path / "c"))[1]
    assert all("there is no cache key at" in r["problem"] for r in rows)
    code, _, err = run_cli("verify", "--dir", str(tmp_path / "c"))
    assert code == 2 and "no entry can be verified" in err
    assert tree(tmp_path / "c") == before and not own_key.exists()


def test_an_untrusted_cache_is_refused_with_the_fix(tmp_path):
    fill(tmp_path / "c")
    os.chmod(tmp_path / "c" / "v2" / "entries", 0o777)
    code, _, err = run_cli("ls", "--dir", str(tmp_path / "c"))
    entries = tmp_path / "c" / "v2" / "entries"
    assert code == 2 and f"writable by group or others (mode 0777): run chmod 700 {entries}" in err


def evil_archive(path) -> str:
    manifest = json.dumps({"schema": "v2", "versions": versions(), "keys": []}).encode()
    with tarfile.open(path, "w:gz") as tar:
        for name, data in (("manifest.json", manifest), ("../escaped", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_import_problems_are_messages_not_tracebacks(tmp_path, monkeypatch, own_key):
    code, out, err = run_cli("import", evil_archive(tmp_path / "evil.tgz"), "--dir", str(tmp_path / "d"), "--json")
    assert code == 2 and "unexpected member '../escaped'" in json.loads(out)["error"] and "Traceback" not in err
    code, _, err = run_cli("import", str(tmp_path / "missing.tgz"), "--dir", str(tmp_path / "new"))
    assert code == 2 and "missing.tgz does not exist; give the file `ascend-dsa cache export FILE` wrote" in err
    assert not (tmp_path / "new").exists(), "a missing archive creates no cache"

    theirs = tmp_path / "theirs" / "cache.key"
    monkeypatch.setenv("ASCEND_DSA_KEY_FILE", str(theirs))
    fill(tmp_path / "c")
    assert run_cli("export", str(tmp_path / "a.tgz"), "--dir", str(tmp_path / "c"))[0] == 0
    monkeypatch.setenv("ASCEND_DSA_KEY_FILE", str(own_key))
    code, out, err = run_cli("import", str(tmp_path / "a.tgz"), "--dir", str(tmp_path / "d"), "--json")
    assert code == 1 and json.loads(out)["imported"] == 0 and len(json.loads(out)["refused"]) == 2
    assert "2 entries refused (its tag does not verify under your key" in err and "--trust" in err
    assert as_json("import", str(tmp_path / "a.tgz"), "--dir", str(tmp_path / "d"), "--key", str(theirs)) == \
        (0, {"imported": 2, "already_present": 0, "refused": []})
    assert as_json("verify", "--dir", str(tmp_path / "d"))[1]["ok"] == 2
    assert as_json("import", str(tmp_path / "a.tgz"), "--dir", str(tmp_path / "e"), "--trust")[1]["imported"] == 2


def test_ls_prints_sizes_as_prune_reads_them(tmp_path):
    keys = fill(tmp_path / "c")
    sizes = {row["key"]: row["size"] for row in as_json("ls", "--dir", str(tmp_path / "c"))[1]}
    code, out, _ = run_cli("ls", "--dir", str(tmp_path / "c"))
    assert code == 0
    for key in keys:
        line = next(line for line in out.splitlines() if key[:16] in line)
        shown = format_size(sizes[key])
        assert re.search(rf"│\s*{re.escape(shown)}\s*│", line) and shown[-1] in "BKMGT", line
        assert abs(parse_size(shown) - sizes[key]) <= 0.05 * parse_size("1" + shown[-1])

"""npu_graph.cache.trust: the per-user key, tags, and the checks on private folders and files."""
import os
import threading

import pytest
from cache_helpers import owned_by_someone_else

from npu_graph.cache import trust
from npu_graph.cache.trust import UntrustedPath


@pytest.fixture
def key_file(tmp_path, monkeypatch):
    path = tmp_path / "config" / "ascend_dsa" / "cache.key"
    monkeypatch.setenv("ASCEND_DSA_KEY_FILE", str(path))
    return path


def test_key_path_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("ASCEND_DSA_KEY_FILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    assert trust.key_path() == tmp_path / "home" / ".config" / "ascend_dsa" / "cache.key"
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/ignored")
    assert trust.key_path() == tmp_path / "home" / ".config" / "ascend_dsa" / "cache.key"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert trust.key_path() == tmp_path / "xdg" / "ascend_dsa" / "cache.key"
    monkeypatch.setenv("ASCEND_DSA_KEY_FILE", str(tmp_path / "k"))
    assert trust.key_path() == tmp_path / "k"


def test_user_key_is_made_once_private_and_kept(key_file):
    with pytest.raises(FileNotFoundError):
        trust.user_key(create=False)
    assert not key_file.parent.exists()
    old = os.umask(0o277)  # a umask that takes the owner's bits away changes no folder's mode
    try:
        key = trust.user_key()
    finally:
        os.umask(old)
    assert len(key) == trust.KEY_BYTES and trust.user_key() == key == trust.user_key(create=False)
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert key_file.parent.stat().st_mode & 0o777 == 0o700
    assert key_file.parent.parent.stat().st_mode & 0o777 == 0o700
    assert os.listdir(key_file.parent) == ["cache.key"]


def test_processes_making_the_key_at_once_agree(key_file):
    keys, start = [], threading.Barrier(8)

    def make():
        start.wait()
        keys.append(trust.user_key())

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(keys)) == 1 and os.listdir(key_file.parent) == ["cache.key"]


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620])
def test_a_key_others_can_read_or_write_is_refused(key_file, mode):
    trust.user_key()
    os.chmod(key_file, mode)
    with pytest.raises(UntrustedPath, match=rf"readable or writable by group or others \(mode 0{mode:o}\): "
                                            rf"run chmod 600 {key_file}"):
        trust.user_key()


def test_a_linked_short_or_foreign_key_is_refused(key_file, tmp_path):
    trust.user_key()
    target = tmp_path / "elsewhere.key"
    os.replace(key_file, target)
    os.symlink(target, key_file)
    with pytest.raises(UntrustedPath, match="symbolic link"):
        trust.user_key()
    os.unlink(key_file)
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"short")
    os.close(fd)
    with pytest.raises(UntrustedPath, match="fewer than 32"):
        trust.user_key()
    os.replace(target, key_file)
    with owned_by_someone_else(key_file), pytest.raises(UntrustedPath, match=r"owned by uid \d+, not you"):
        trust.user_key()


def test_tags_verify_only_the_same_data_under_the_same_key(key_file):
    data = b"meta.json contents"
    tag = trust.tag(data)
    assert len(tag) == 64 and trust.verify_tag(data, tag)
    assert not trust.verify_tag(data + b" ", tag)
    assert not trust.verify_tag(data, trust.tag(data, b"k" * 32))
    assert trust.verify_tag(data, trust.tag(data, b"k" * 32), b"k" * 32)
    assert not trust.verify_tag(data, tag.upper()) and not trust.verify_tag(data, "é" * 64)
    assert not trust.verify_tag(data, None)


def test_check_private_dir(tmp_path):
    folder = tmp_path / "cache"
    with pytest.raises(FileNotFoundError):
        trust.check_private_dir(folder)
    assert not folder.exists()
    folder.mkdir(mode=0o700)
    trust.check_private_dir(folder)
    os.chmod(folder, 0o755)
    trust.check_private_dir(folder)  # readable by others is fine: only writing is a threat
    os.chmod(folder, 0o775)
    with pytest.raises(UntrustedPath, match=rf"writable by group or others \(mode 0775\): run chmod 700 {folder}"):
        trust.check_private_dir(folder)
    os.chmod(folder, 0o700)
    (tmp_path / "link").symlink_to(folder)
    with pytest.raises(UntrustedPath, match="symbolic link"):
        trust.check_private_dir(tmp_path / "link")
    (tmp_path / "file").touch()
    with pytest.raises(UntrustedPath, match="not a directory"):
        trust.check_private_dir(tmp_path / "file")
    with owned_by_someone_else(folder), pytest.raises(UntrustedPath, match=rf"{folder} is owned by uid \d+, not you"):
        trust.check_private_dir(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_folder_really_owned_by_another_user_is_refused(tmp_path):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, 12345, 12345)
    with pytest.raises(UntrustedPath, match="owned by uid 12345, not you"):
        trust.check_private_dir(folder)


def test_ensure_private_dir_makes_parents_private_and_checks_what_exists(tmp_path):
    folder = tmp_path / "a" / "b" / "c"
    assert trust.ensure_private_dir(folder) == folder
    assert all((tmp_path / p).stat().st_mode & 0o777 == 0o700 for p in ("a", "a/b", "a/b/c"))
    os.chmod(folder, 0o777)
    with pytest.raises(UntrustedPath, match="chmod 700"):
        trust.ensure_private_dir(folder)


def test_check_private_file_and_reads(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"data")
    os.chmod(path, 0o644)
    trust.check_private_file(path)
    assert trust.read_private_file(path) == b"data"
    os.chmod(path, 0o666)
    for check in (trust.check_private_file, trust.read_private_file):
        with pytest.raises(UntrustedPath, match=r"mode 0666\): run chmod 600"):
            check(path)
    os.chmod(path, 0o600)
    (tmp_path / "link").symlink_to(path)
    for check in (trust.check_private_file, trust.read_private_file):
        with pytest.raises(UntrustedPath, match="symbolic link"):
            check(tmp_path / "link")
    os.mkfifo(tmp_path / "fifo", 0o600)  # must not block waiting for a writer
    with pytest.raises(UntrustedPath, match="not a regular file"):
        trust.read_private_file(tmp_path / "fifo")
    with pytest.raises(UntrustedPath, match="not a regular file"):
        trust.check_private_file(tmp_path)

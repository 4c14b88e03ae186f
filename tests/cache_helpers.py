"""Helpers for the compile-cache tests: a small model compiled through a cache folder, a key of the test's own,
a read-only cache, files that look owned by another user, and an entry with a payload appended to its source."""
import contextlib
import errno
import hashlib
import json
import os
import re
import textwrap
import warnings
from collections.abc import Iterator

import pytest
import torch

import npu_graph
from npu_graph.cache.disk_store import CacheWarning

MODEL = textwrap.dedent("""
    import torch
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        def forward(self, x):
            return self.b(torch.relu(self.a(x))).softmax(-1) * torch.tensor([2.0])
""")
namespace: dict = {}
exec(MODEL, namespace)
Net = namespace["Net"]


def isolated_key():
    """An autouse fixture (assign it in the test module) that gives each test a cache key of its own, so the
    tests never read or make the key in the home folder."""
    @pytest.fixture(autouse=True)
    def own_key(tmp_path, monkeypatch):
        monkeypatch.setenv("ASCEND_DSA_KEY_FILE", str(tmp_path / "keys" / "cache.key"))

    return own_key


def compile_once(cache_dir, model=None, x=None, **options):
    """Compile Net (or `model`) through the cache at `cache_dir` in a fresh Dynamo; returns (report, output)
    after checking the output against eager and that the graph was compiled (no eager fallback)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = model or Net()
    x = torch.randn(4, 16) if x is None else x
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache_dir": str(cache_dir), **options}))
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)
        torch.testing.assert_close(out, model(x))
    assert all(r.fallback is None for r in backend.reports), [r.fallback for r in backend.reports]
    return backend.reports[-1], out


@contextlib.contextmanager
def one_cache_warning(match: str) -> Iterator[None]:
    """The block gives exactly one CacheWarning, and it matches `match`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    said = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert len(said) == 1 and re.search(match, said[0]), said


def add_payload(folder, marker) -> None:
    """Append code that touches `marker` to the entry's compiled.py and fix up the hash meta.json records."""
    source = os.path.join(folder, "compiled.py")
    with open(source, "a") as f:
        f.write(f"\nimport pathlib; pathlib.Path({str(marker)!r}).touch()\n")
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    with open(source, "rb") as f:
        meta["files"]["compiled.py"] = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f)


def _under(root: str, path, dir_fd=None) -> bool:
    if not isinstance(path, (str, bytes, os.PathLike)):
        return False
    path = os.fsdecode(path)
    if dir_fd is not None:
        path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    path = os.path.abspath(path)
    return path == root or path.startswith(root + os.sep)


def _refusing(fn, root: str, writes=lambda args, kwargs: True):
    def patched(*args, **kwargs):
        paths = [a for a in args if isinstance(a, (str, bytes, os.PathLike))]
        if writes(args, kwargs) and any(_under(root, p, kwargs.get("dir_fd")) for p in paths):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(paths[0]))
        return fn(*args, **kwargs)

    return patched


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@contextlib.contextmanager
def read_only(root) -> Iterator[None]:
    """Make the tree under `root` unwritable, as a read-only mount is. As a normal user, chmod a-w on every
    folder; as root, whom permission bits do not stop, the os functions that write raise EROFS there."""
    root = os.path.realpath(root)
    if os.geteuid() != 0:
        folders = [top for top, _, _ in os.walk(root)]
        for folder in folders:
            os.chmod(folder, 0o500)
        try:
            yield
        finally:
            for folder in folders:
                os.chmod(folder, 0o700)
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "open", _refusing(os.open, root, lambda args, kwargs: args[1] & _WRITE_FLAGS))
        for name in ("mkdir", "rename", "replace", "unlink", "rmdir", "utime", "link", "chmod"):
            mp.setattr(os, name, _refusing(getattr(os, name), root))
        yield


@contextlib.contextmanager
def owned_by_someone_else(path) -> Iterator[None]:
    """Files and folders at or under `path` report another user's uid to os.lstat / os.stat / os.fstat (the
    real chown needs root; tests that need the real thing do it themselves)."""
    root = os.path.realpath(path)
    other = os.getuid() + 1

    def foreign(st):
        fields = list(st)
        fields[4] = other
        return os.stat_result(fields)

    def by_path(fn):
        return lambda p, *a, **k: foreign(fn(p, *a, **k)) if _under(root, p, k.get("dir_fd")) else fn(p, *a, **k)

    real_fstat = os.fstat
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "lstat", by_path(os.lstat))
        mp.setattr(os, "stat", by_path(os.stat))
        mp.setattr(os, "fstat", lambda fd: foreign(real_fstat(fd)) if _under(root, os.readlink(f"/proc/self/fd/{fd}"))
                   else real_fstat(fd))
        yield

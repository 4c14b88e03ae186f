"""What the compile cache (and the native build directory) trusts on disk, and the checks that enforce it.

Compiled code is read from disk and run, so a file is trusted only when
1. it, and the folder it is found in, is owned by the current user, is not a symbolic link and is not
   writable by group or others (the folders are created 0700, the files 0600); and
2. its contents carry a valid tag: HMAC-SHA256 under a per-user secret key (32 random bytes kept with
   mode 0600 in a 0700 folder: `ASCEND_DSA_KEY_FILE`, else `$XDG_CONFIG_HOME/ascend_dsa/cache.key`, by default
   `~/.config/ascend_dsa/cache.key`).
The first rule is the model of Inductor's and torchair's caches, which live in per-user directories: whoever
can write there can already run code as the user. The second closes what the first leaves open: a file copied
from elsewhere (an archive, a shared mount, a container image) or edited in place, even with its recorded
hashes fixed up, carries no tag that verifies, because only a holder of the key can compute one; so its code
never runs. The key does not protect against code that already runs as the user: it can read the key.

A path that breaks rule 1 raises UntrustedPath (an OSError) whose message names the path, what is wrong and
how to fix it. `check_*` functions only look; `ensure_private_dir` and `user_key()` create what is missing.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

KEY_BYTES = 32
_GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH
_GROUP_OTHER_ANY = 0o077


class UntrustedPath(OSError):
    """A file or folder that breaks the trust rules; the message says what is wrong and how to fix it."""


def key_path() -> Path:
    """Where the per-user key lives: ASCEND_DSA_KEY_FILE, else $XDG_CONFIG_HOME/ascend_dsa/cache.key."""
    explicit = os.environ.get("ASCEND_DSA_KEY_FILE")
    if explicit:
        return Path(explicit).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME", "")
    if not os.path.isabs(config):  # the XDG spec says to ignore a relative value
        config = os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "ascend_dsa" / "cache.key"


def _check(st: os.stat_result, path: Path | str, folder: bool, forbidden: int = _GROUP_OTHER_WRITE) -> None:
    kind, fix = ("directory", "700") if folder else ("file", "600")
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedPath(f"{path} is a symbolic link, not a {kind}: the cache follows no links")
    if not (stat.S_ISDIR(st.st_mode) if folder else stat.S_ISREG(st.st_mode)):
        raise UntrustedPath(f"{path} is not a {'directory' if folder else 'regular file'}")
    if st.st_uid != os.getuid():
        raise UntrustedPath(f"{path} is owned by uid {st.st_uid}, not you (uid {os.getuid()})")
    if st.st_mode & forbidden:
        what = "readable or writable" if forbidden & stat.S_IRGRP else "writable"
        raise UntrustedPath(f"{path} is {what} by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
                            f"run chmod {fix} {path}")


def check_private_dir(path: Path | str) -> None:
    """Raise UntrustedPath unless `path` is a directory (not a link) owned by us and not group/other-writable;
    creates nothing (a missing path raises FileNotFoundError)."""
    _check(os.lstat(path), path, folder=True)


def check_private_file(path: Path | str) -> None:
    """Raise UntrustedPath unless `path` is a regular file (not a link) owned by us and not group/other-writable."""
    _check(os.lstat(path), path, folder=False)


def ensure_private_dir(path: Path | str) -> Path:
    """Create `path` and its missing parents with mode 0700, then check it as check_private_dir does."""
    path = Path(path)
    missing = []
    parent = path
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = parent.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it first: it is checked below
            os.mkdir(folder, 0o700)
            os.chmod(folder, 0o700)  # whatever the umask
    check_private_dir(path)
    return path


def open_private_file(path: Path | str, forbidden: int = _GROUP_OTHER_WRITE) -> int:
    """A read-only descriptor of a file that passes check_private_file, checked on the open file itself (no link
    is followed, and what is checked is what is read). The caller closes it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedPath(f"{path} is a symbolic link, not a file: the cache follows no links") from exc
        raise
    try:
        _check(os.fstat(fd), path, folder=False, forbidden=forbidden)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_private_file(path: Path | str, forbidden: int = _GROUP_OTHER_WRITE) -> bytes:
    """The bytes of a file that passes check_private_file (open_private_file)."""
    with os.fdopen(open_private_file(path, forbidden), "rb") as f:
        return f.read()


def _read_key(path: Path) -> bytes:
    key = read_private_file(path, forbidden=_GROUP_OTHER_ANY)
    if len(key) < KEY_BYTES:
        raise UntrustedPath(f"{path} holds {len(key)} bytes, fewer than {KEY_BYTES}: delete it to make a new key "
                            f"(entries tagged with the old one are then recompiled)")
    return key


def _create_key(path: Path) -> None:
    """Write a new key under a temporary name and link it into place, so that a reader never sees a partial
    key and two processes creating it at once end up with the same one."""
    ensure_private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # whatever the umask
            f.write(secrets.token_bytes(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # another process won the race: its key is used
            os.link(tmp, path)
    finally:
        os.unlink(tmp)


def user_key(create: bool = True) -> bytes:
    """This user's secret key, created (0600, in a 0700 folder) on first use unless create=False, in which case
    a missing key raises FileNotFoundError. A key file that is not ours, is a link, or is readable or writable
    by group or others raises UntrustedPath."""
    path = key_path()
    try:
        return _read_key(path)
    except FileNotFoundError:
        if not create:
            raise
    _create_key(path)
    return _read_key(path)


def _hmac_hex(data: bytes, key: bytes | None) -> str:
    return hmac.new(user_key() if key is None else key, data, hashlib.sha256).hexdigest()


def tag(data: bytes, key: bytes | None = None) -> str:
    """Hex HMAC-SHA256 of `data` under `key` (default: this user's key)."""
    return _hmac_hex(data, key)


def verify_tag(data: bytes, tag: str, key: bytes | None = None) -> bool:
    """Whether `tag` is the tag of `data` under `key` (default: this user's key); compared in constant time."""
    if not isinstance(tag, str):
        return False
    return hmac.compare_digest(_hmac_hex(data, key).encode(), tag.encode("utf-8", "replace"))

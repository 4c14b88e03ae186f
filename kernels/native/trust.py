"""Which built native libraries kernels/native/loader.py loads: only its own (npu_graph/cache/trust.py's rules).

The build folder must be a private folder of this user (0700 when created; refused when another user owns it or
group / others can write it). Each library is built next to a record `<library>.record` holding the SHA-256 of
its bytes and an HMAC tag of that digest under this user's key: a library is loaded only when its bytes hash to
the recorded digest and the tag verifies, checked on the open file that is then loaded (/proc/self/fd), so a
library planted under the expected name, or edited after it was built, is refused (and rebuilt).
"""
from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path

from npu_graph.cache import trust

RECORD_SUFFIX = ".record"


@functools.cache
def _key() -> bytes:
    """This user's key, read once per process: libraries load once per process, and a test that points
    ASCEND_DSA_KEY_FILE elsewhere for the compile cache must not make this process distrust its own builds."""
    return trust.user_key()


def record_path(library: Path) -> Path:
    return library.with_name(library.name + RECORD_SUFFIX)


def _statement(library: Path, digest: str) -> bytes:
    return f"ascend_dsa native library {library.name} sha256 {digest}".encode()


def write_record(library: Path, data: bytes) -> None:
    """Records the digest of `data` (the library's bytes, before it is renamed into place) and its tag."""
    digest = hashlib.sha256(data).hexdigest()
    text = f"{digest} {trust.tag(_statement(library, digest), _key())}\n"
    fd, tmp = tempfile.mkstemp(dir=library.parent, prefix=library.name + ".", suffix=".record.tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, record_path(library))


def open_verified(library: Path) -> tuple[int | None, str]:
    """(a descriptor of the library, "") when it is one this user built, else (None, why it is refused)."""
    try:
        digest, tag = trust.read_private_file(record_path(library)).decode().split()
        fd = trust.open_private_file(library)
    except FileNotFoundError:
        return None, "it has no build record (it was not built here)"
    except (ValueError, UnicodeDecodeError):
        return None, "its build record is damaged"
    except trust.UntrustedPath as e:
        return None, str(e)
    with os.fdopen(os.dup(fd), "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != digest:
        os.close(fd)
        return None, "its bytes differ from the ones recorded when it was built"
    if not trust.verify_tag(_statement(library, digest), tag, _key()):
        os.close(fd)
        return None, "its build record does not carry this user's tag"
    return fd, ""


def loadable_path(library: Path, fd: int) -> str:
    """The name to dlopen: the open, verified file itself where /proc/self/fd exists, else its path. Keep `fd`
    open while the process runs: the loader knows libraries by name, and a reused number names another file."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else str(library)

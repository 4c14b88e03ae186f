"""The torch versions this package is tested with, checked at import without importing torch.

The compiler uses private torch APIs (AOT autograd internals, torch._library, Dynamo's compile ids), so it
declares the minor versions its tests run on (setup.py's install_requires says the same) and refuses any
other torch at import with a message that names both versions and what to do, instead of failing later with
an AttributeError deep in a compile. ASCEND_DSA_ALLOW_UNTESTED_TORCH=1 lets a user try another torch anyway.
"""
from __future__ import annotations

import os
import re
from importlib import metadata

TESTED_TORCH = ((2, 13),)           # (major, minor) pairs the test suite runs on
ENV_ALLOW = "ASCEND_DSA_ALLOW_UNTESTED_TORCH"


class UnsupportedTorchError(ImportError):
    """The installed torch is outside the tested range (module docstring)."""


def _major_minor(version: str) -> tuple[int, int] | None:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def check_torch(version: str | None = None) -> None:
    """Raise UnsupportedTorchError unless torch `version` (default: the installed one) is a tested minor
    version or ASCEND_DSA_ALLOW_UNTESTED_TORCH=1 is set."""
    if os.environ.get(ENV_ALLOW, "") not in ("", "0"):
        return
    if version is None:
        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            raise UnsupportedTorchError("ascend-dsa needs torch: pip install torch==2.13.0") from None
    if _major_minor(version) in TESTED_TORCH:
        return
    tested = ", ".join(f"{major}.{minor}.x" for major, minor in TESTED_TORCH)
    raise UnsupportedTorchError(
        f"ascend-dsa is tested with torch {tested}, but torch {version} is installed. Install a tested torch "
        f"(pip install torch==2.13.0), or set {ENV_ALLOW}=1 to try this one (the compiler uses private torch "
        f"APIs that change between releases).")

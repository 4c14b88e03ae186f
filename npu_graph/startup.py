"""What `import npu_graph` does, without importing torch when nothing has yet.

First it checks the installed torch against the minor versions the tests run on, from package metadata (torch
is not imported for it): the compiler uses private torch APIs (AOT autograd internals, torch._library, Dynamo's
compile ids), so any other torch is refused with a message that names both versions and what to do, instead of
an AttributeError deep in a compile (setup.py's install_requires says the same);
ASCEND_DSA_ALLOW_UNTESTED_TORCH=1 lets a user try another torch anyway.

The package's work at import (registering its own `torch.ops.ascend_dsa.*` fused ops; it patches nothing of
other libraries: the kernel routes are installed when the backend is resolved, npu_graph.backend) runs at once
when torch is already imported, else right after torch's own import finishes (a one-shot
import hook). The backend is imported when a public name such as `get_backend` (or `npu_graph.backend`) is
first read. So import order does not matter, and a command that never needs torch (`ascend-dsa --help`)
never pays for it.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from importlib import metadata
from types import ModuleType
from typing import Any

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


PUBLIC = {"Backend": "npu_graph.backend", "ascend_dsa": "npu_graph.backend", "get_backend": "npu_graph.backend",
          "CompilerConfig": "npu_graph.config", "ConfigError": "npu_graph.config",
          "install_routes": "npu_graph.routes"}
SUBMODULES = ("backend", "config", "kernels")  # read as attributes of npu_graph without being imported
_state = {"loaded": False}


def load() -> None:
    """Register the fused ops (once per process).

    Safe while npu_graph.kernels is itself being imported (its first `import torch` runs this hook): the
    partly run package is left to finish registering its ops."""
    if _state["loaded"]:
        return
    _state["loaded"] = True
    try:
        importlib.import_module("npu_graph.kernels")
    except BaseException:
        _state["loaded"] = False
        raise


def public_name(name: str) -> Any:
    """The package attribute `name` (a public name or a core submodule), imported on first use."""
    if name in SUBMODULES:
        load()
        return importlib.import_module(f"npu_graph.{name}")
    if name not in PUBLIC:
        raise AttributeError(f"module 'npu_graph' has no attribute {name!r}")
    load()
    value = getattr(importlib.import_module(PUBLIC[name]), name)
    setattr(sys.modules["npu_graph"], name, value)
    return value


class _LoadAfterTorch(importlib.abc.MetaPathFinder):
    """Finds torch as the other finders do and runs `load` right after torch's own module has run."""

    def __init__(self) -> None:
        self.searching = False

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch" or self.searching:
            return None
        self.searching = True
        try:
            spec = importlib.util.find_spec("torch")
        finally:
            self.searching = False
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_then_load(module: ModuleType) -> None:
            execute(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            load()

        spec.loader.exec_module = exec_then_load  # type: ignore[method-assign]
        return spec


def load_now_or_after_torch() -> None:
    """Load at once when torch is imported, else right after it is."""
    if "torch" in sys.modules:
        load()
    elif not any(isinstance(f, _LoadAfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _LoadAfterTorch())

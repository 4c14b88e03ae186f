"""ascend_dsa's names in torch's logging, so `TORCH_LOGS` and `torch._logging.set_logs` control them:

    TORCH_LOGS=ascend_dsa         the `npu_graph` logger at INFO: each graph, where it came from, its time
    TORCH_LOGS=+ascend_dsa        the same at DEBUG
    TORCH_LOGS=ascend_dsa_code    the generated code of each graph (as Inductor's `output_code`)

torch parses TORCH_LOGS while it is imported and rejects a name it does not know, before any compiler backend
is loaded; it first calls the `torch.backends` entry points, and this module is ours (`register_at_torch_import`).
It is a top-level module on purpose: an entry point inside npu_graph would run the package's import (its ops,
its torch version check) in every `import torch` of the environment, and a failure there fails `import torch`.
Here it costs one environment lookup, and the names are registered only when TORCH_LOGS asks for one of them:
a registered logger belongs to torch's logging (its handler, no propagation to the root logger), so the
`npu_graph` logger otherwise stays a plain Python logger. The backend registers the names again when it is
imported (npu_graph.observe.trace), so `torch._logging.set_logs(modules={"ascend_dsa": logging.INFO})` works
in any process.
"""
from __future__ import annotations

import logging
import os
import re

LOG = "ascend_dsa"
CODE = "ascend_dsa_code"
LOGGER = "npu_graph"
_CODE_DESCRIPTION = "the generated code of each graph the ascend_dsa backend compiles or loads from its cache"


def register() -> None:
    """Make `ascend_dsa` (the npu_graph logger) and the `ascend_dsa_code` artifact known to torch's logging."""
    from torch._logging import _internal

    _internal.register_log(LOG, LOGGER)
    _internal.register_artifact(CODE, _CODE_DESCRIPTION, visible=True, off_by_default=True)


def named_in(settings: str) -> bool:
    """True when a TORCH_LOGS value names one of ours (`ascend_dsa`, `+ascend_dsa`, `ascend_dsa_code`, ...)."""
    return any(name.lstrip("+-") in (LOG, CODE) for name in re.split(r"[,\s]+", settings))


def register_at_torch_import() -> None:
    """The `torch.backends` entry point, called by torch before it parses TORCH_LOGS. It must not raise (torch
    would fail to import), so a problem is logged and only skips the registration."""
    if not named_in(os.environ.get("TORCH_LOGS", "")):
        return
    try:
        register()
    except Exception as exc:  # torch turns any error raised here into a failed `import torch`
        logging.getLogger(LOGGER).warning("ascend_dsa: could not register its TORCH_LOGS names (%s)", exc)

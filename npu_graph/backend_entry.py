"""The `torch_dynamo_backends` entry point of `ascend_dsa` (setup.py): torch resolves the name here the first time
a process asks for the backend (`torch.compile(..., backend="ascend_dsa")`, before Dynamo traces anything), and
that is when the native libraries not yet built start building on a thread (kernels/native/prebuild.start_ahead),
so that g++ runs beside Dynamo's tracing of the first graph. Importing npu_graph starts nothing."""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name != "ascend_dsa":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from npu_graph.backend import ascend_dsa
    from npu_graph.kernels.native import prebuild as native_prebuild
    native_prebuild.start_ahead()
    return ascend_dsa

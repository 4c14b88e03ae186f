"""ascend-dsa: a torch.compile backend (`backend="ascend_dsa"`) for sparse and hybrid LLMs.

Importing npu_graph registers the `torch.ops.ascend_dsa.*` fused operators: at once when torch is already
imported, else as soon as torch is (npu_graph.startup), so `import npu_graph` alone does not import torch.
"""
from typing import Any

from npu_graph.startup import check_torch, load_now_or_after_torch, public_name

__version__ = "0.1.0"
__all__ = ["Backend", "CompilerConfig", "ConfigError", "__version__", "ascend_dsa", "get_backend", "install_routes"]


def __getattr__(name: str) -> Any:
    return public_name(name)


check_torch()
load_now_or_after_torch()

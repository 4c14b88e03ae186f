"""ascend-dsa: a torch.compile backend (`backend="ascend_dsa"`) for sparse and hybrid LLMs.

Importing npu_graph registers the `torch.ops.ascend_dsa.*` fused operators.
"""
from npu_graph import kernels  # noqa: F401  (registers torch.ops.ascend_dsa)
from npu_graph.backend import Backend, ascend_dsa, get_backend
from npu_graph.config import CompilerConfig, ConfigError
from npu_graph.routes import install_routes

install_routes()

__version__ = "0.1.0"
__all__ = ["Backend", "CompilerConfig", "ConfigError", "__version__", "ascend_dsa", "get_backend"]

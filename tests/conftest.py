"""Shared test fixtures: the native kernels forced on, a clean Dynamo state and no kernel call plans per test
(kernels/native/call_plans: a test may patch what a plan was decided from), torch's thread count set for one test, a
temporary dump folder,
and tiny random-config transformers models (no downloads)."""
import os

import pytest
import torch

from npu_graph.kernels.native import call_plans
from npu_graph.models.tiny_transformers import build_tiny

# Native kernels wherever they apply (kernels/native/dispatch.py's "force" mode), so every test knows which path ran and
# none depends on a timing; the dispatch tests set "auto" themselves. Processes the tests start inherit it.
os.environ.setdefault("ASCEND_DSA_NATIVE", "1")
# Graphs run as generated Python: Inductor's glue (npu_graph.runtime.inductor_glue) compiles C++ for each graph,
# seconds a graph, which hundreds of small test graphs cannot afford. Its tests ask for it by option (options win
# over the environment): tests/targets/test_inductor_glue.py and the generate() idiom tests.
os.environ.setdefault("ASCEND_DSA_CPU_GLUE", "python")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    call_plans.clear_all()
    yield
    torch._dynamo.reset()


@pytest.fixture
def torch_threads():
    """torch.set_num_threads for the test; the count it had is restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def no_cache_options(tmp_path):
    return {"cache": False, "dump_dir": str(tmp_path / "dump")}


def _build_tiny(name: str, seed: int = 0, attn_implementation: str | None = None) -> torch.nn.Module:
    pytest.importorskip("transformers")
    return build_tiny(name, seed, attn_implementation)


@pytest.fixture
def tiny_transformers():
    """build(name, seed=0, attn_implementation=None): a tiny random-config transformers causal LM in eval mode."""
    return _build_tiny

"""ascend_dsa as vLLM's compile backend, in the environment tools/vllm_env.sh builds (skipped where vLLM is absent):
for each tiny family, 4 prompts x 32 greedy tokens through `vllm.LLM` with `compilation_config={"backend":
"ascend_dsa"}` (vLLM's compile mode, its AOT compile on) equal vLLM's eager tokens; the backend compiled the
whole model as one graph, as vLLM's CPU platform does for its own default; a second process on the same caches
loads vLLM's AOT program and our entries, compiles nothing, and its torch.compile time is at most 0.2x the cold
one."""
import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: tools/vllm_env.sh DIR builds its environment and runs "
                                   "these tests there")

from npu_graph.tools.bench_serve import serve_in_child
from npu_graph.vllm.checkpoints import FAMILIES, build_checkpoint

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", FAMILIES)
def test_ascend_dsa_serves_the_eager_tokens_and_starts_warm_without_compiling(tmp_path, family):
    spec = {"folder": build_checkpoint(family, str(tmp_path / family)), "prompts": 4, "new_tokens": 32}
    eager = serve_in_child({**spec, "mode": "eager"}, str(tmp_path / "eager"))
    ours = str(tmp_path / "ours")
    cold = serve_in_child({**spec, "mode": "ascend_dsa"}, ours)
    warm = serve_in_child({**spec, "mode": "ascend_dsa"}, ours)
    assert cold["tokens"] == eager["tokens"] and warm["tokens"] == eager["tokens"]
    assert cold["graphs_compiled"] == 1, "vLLM on CPU compiles one whole graph; ascend_dsa should get the same"
    assert warm["graphs_compiled"] == 0 and warm["graphs_loaded"] == cold["graphs_compiled"]
    assert warm["compile_s"] <= 0.2 * cold["compile_s"], (warm["compile_s"], cold["compile_s"])
    assert os.listdir(os.path.join(ours, "torch_compile_cache"))


def test_vllm_custom_norm_ops_are_fused_and_serve_the_eager_tokens(tmp_path):
    """With vLLM's custom RMSNorm and SiLU-and-mul ops on, the norms reach the backend as `_C` calls: they become
    ascend_dsa's fused norms (the vllm_ops pass), and the tokens stay the eager ones."""
    spec = {"folder": build_checkpoint("llama", str(tmp_path / "llama")), "prompts": 4, "new_tokens": 32}
    eager = serve_in_child({**spec, "mode": "eager"}, str(tmp_path / "eager"))
    ours = serve_in_child({**spec, "mode": "ascend_dsa", "custom_ops": ["+rms_norm", "+silu_and_mul"]},
                          str(tmp_path / "ours"))
    assert ours["tokens"] == eager["tokens"]
    assert ours["fused_ops"].get("add_rms_norm", 0) >= 1 and ours["fused_ops"].get("rms_norm", 0) >= 1, ours

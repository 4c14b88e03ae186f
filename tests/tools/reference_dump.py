"""A dump of the reference model's prefill graph, compiled once per test session and shared by the
inspect and HTML report tests (each module asks for it through a module-scoped fixture)."""
import shutil

import torch

from npu_graph.models.hybrid import HybridConfig, HybridLM


def build_reference_dump(tmp_path_factory) -> str:
    """Path of the dump folder; compiled on the first call of the session, reused afterwards."""
    root = tmp_path_factory.getbasetemp() / "hybrid_reference_dump"
    dump = root / "dump"
    if not (root / "done").exists():
        shutil.rmtree(root, ignore_errors=True)
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = HybridLM(HybridConfig.named("tiny")).eval()
        # without a stream plan: the inspect and HTML tests check the "not planned" / serial-order paths
        options = {"dump_dir": str(dump), "cache": False, "disabled_passes": ["assign_streams"]}
        compiled = torch.compile(model, backend="ascend_dsa", options=options)
        ids = torch.randint(3, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            compiled(ids, model.new_cache(1))
        torch._dynamo.reset()
        (root / "done").write_text("ok")
    return str(dump)

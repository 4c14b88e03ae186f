"""`ascend-dsa bench spec`'s pieces on the tiny model (eager): a model given room for a longer context decodes as
the original, one whose MLPs are widened by zero units (`--wide`) computes what it did, and every row decodes plain
greedy's tokens from one shared prefill, with its cost split."""
import dataclasses

import torch

from npu_graph.generate import Decoder
from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.tools import bench_spec


def mtp_model() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(dataclasses.replace(HybridConfig.named("tiny"), mtp_layers=1)).eval()


def test_with_context_keeps_the_weights_and_the_tokens():
    model = mtp_model()
    longer = bench_spec.with_context(model, 400)
    assert longer.config.max_context == 416 and model.config.max_context == 256      # 26 blocks of 16
    prompts = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(Decoder(longer).greedy(prompts, 6), Decoder(model).greedy(prompts, 6))


def test_widened_mlps_compute_what_the_model_did():
    model = mtp_model()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids, model.new_cache(2))
        wide = bench_spec.widened(mtp_model(), 1000)
        after = wide(ids, wide.new_cache(2))
    widened = [getattr(layer.mlp, "shared_experts", layer.mlp) for layer in wide.layers]
    assert [mlp.down_proj.in_features for mlp in widened] == [1000] * len(wide.layers)
    assert bench_spec._mlp_bytes(wide) > 3 * bench_spec._mlp_bytes(model)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_rows_decode_plain_greedy_tokens_with_their_cost_split(monkeypatch):
    monkeypatch.setattr(bench_spec, "KS", (2,))
    model = bench_spec.with_context(mtp_model(), 30)
    prompts = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    rows = bench_spec.rows_for(model, Decoder(model).prefill(prompts, draft=True), 8, compiled=False, repeat=1)
    assert [(r["rollback"], r["drafts"]) for r in rows] == [("checkpoint", "mtp"), ("replay", "mtp"),
                                                            ("checkpoint", "oracle")]
    assert all(r["identical"] and not r["compiled"] for r in rows)
    assert all(r["acceptance_rate"] == 1.0 for r in rows if r["drafts"] == "oracle")
    for row in rows:
        split = row["draft_ms"] + row["verify_ms"] + row["rollback_ms"]
        assert row["decode_ms"] > 0 and abs(row["round_in_decode_steps"] - split / row["decode_ms"]) < 1e-9

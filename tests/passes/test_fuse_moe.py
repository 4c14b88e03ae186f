"""fuse_moe_experts and fuse_moe_gating on the ways models write MoE routing and experts: op sets before and
after the two passes and equal numerics; graphs without MoE are left alone; the reference model end to end."""
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import npu_graph
from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.models.moe import DeepSeekMoE, MoEGate
from npu_graph.passes import fuse_moe_experts, fuse_moe_gating

GATING = "ascend_dsa.moe_gating_top_k.default"
FUSED = "ascend_dsa.fused_moe.default"
T, E, H, K = 6, 8, 16, 2


@pytest.fixture
def ops(watch_pass):
    """Compiles with the two MoE passes watched together (see conftest.watch_pass)."""
    return lambda fn, *args: watch_pass((fuse_moe_experts, fuse_moe_gating), fn, *args)


def run(fn, *args, ops, atol=1e-5):
    watched = ops(fn, *args)
    assert watched.report.fallback is None
    torch.testing.assert_close(watched.out, watched.ref, rtol=atol, atol=atol)
    return watched.stats, watched.before, watched.after


def tiny_config() -> HybridConfig:
    return HybridConfig.named("tiny")


def router_inputs(seed=0):
    torch.manual_seed(seed)
    return torch.randn(T, H), torch.randn(E, H), torch.randn(E) * 0.1


def assert_gating_fused(stats, before, after):
    assert stats["matches"] == {fuse_moe_gating.PATTERN: 1} and stats["near_misses"] == []
    assert after[GATING] == 1 and "aten.topk.default" not in after and before["aten.topk.default"] >= 1


def test_reference_gate_and_expert_loop(ops):
    torch.manual_seed(0)
    moe = DeepSeekMoE(tiny_config()).eval()
    torch.nn.init.normal_(moe.gate.weight, std=0.1)
    moe.gate.e_score_correction_bias.normal_(std=0.05)
    stats, before, after = run(moe, torch.randn(2, 5, 64), ops=ops)
    assert stats["matches"] == {fuse_moe_gating.PATTERN: 1, fuse_moe_experts.PATTERN_LOOP: 1}
    assert before["aten.topk.default"] == 3 and before["aten.mm.default"] == 1 + 8 * 3 + 3
    assert after[GATING] == 1 and after[FUSED] == 1 and after["aten.mm.default"] == 1 + 3
    assert "aten.topk.default" not in after and "aten.eq.Scalar" not in after


def test_reference_gate_alone(ops):
    torch.manual_seed(0)
    gate = MoEGate(tiny_config()).eval()
    torch.nn.init.normal_(gate.weight, std=0.1)
    stats, before, after = run(gate, torch.randn(T, 64), ops=ops)
    assert_gating_fused(stats, before, after)
    assert after == Counter({GATING: 1, "aten.mm.default": 1, "aten.t.default": 1, "<built-in function getitem>": 2,
                             "aten._to_copy.default": 1})


def test_deepseek_v3_style_flat_group_mask(ops):
    def router(x, w, bias):
        scores = (x @ w.t()).sigmoid()
        choice = scores + bias
        group_scores = choice.view(-1, 4, E // 4).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=2, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, 4, E // 4).reshape(-1, E)
        ids = torch.topk(choice.masked_fill(~score_mask.bool(), float("-inf")), k=K, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * 2.5, ids

    stats, before, after = run(router, *router_inputs(), ops=ops)
    assert_gating_fused(stats, before, after)


def test_group_max_with_where_mask(ops):
    def router(x, w, bias):
        scores = torch.sigmoid(x @ w.t())
        choice = (scores + bias).view(-1, 4, E // 4)
        keep_idx = choice.amax(dim=-1).topk(3, dim=-1).indices
        keep = torch.zeros(x.shape[0], 4).scatter(1, keep_idx, 1.0).bool()
        ids = torch.where(keep.unsqueeze(-1), choice, float("-inf")).view(-1, E).topk(K, dim=-1).indices
        weights = scores.gather(1, ids)
        return weights / weights.sum(dim=-1, keepdim=True), ids

    stats, before, after = run(router, *router_inputs(1), ops=ops)
    assert_gating_fused(stats, before, after)


def test_softmax_top_k_values_renormalised(ops):
    def router(x, w, _bias):  # Qwen3-MoE with norm_topk_prob
        probs = F.softmax(x @ w.t(), dim=-1, dtype=torch.float)
        weights, ids = probs.topk(K, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids

    stats, before, after = run(router, *router_inputs(2), ops=ops)
    assert_gating_fused(stats, before, after)


def test_softmax_gathered_without_renormalisation(ops):
    def router(x, w, _bias):
        probs = (x @ w.t()).softmax(-1)
        ids = probs.topk(K, dim=-1).indices
        return probs.gather(-1, ids) * 1.5, ids

    stats, before, after = run(router, *router_inputs(3), ops=ops)
    assert_gating_fused(stats, before, after)


def test_sigmoid_without_renormalisation_is_a_near_miss(ops):
    def router(x, w, bias):
        scores = (x @ w.t()).sigmoid()
        ids = (scores + bias).topk(K, dim=-1).indices
        return scores.gather(1, ids), ids

    stats, before, after = run(router, *router_inputs(), ops=ops)
    assert stats["matches"] == {} and before == after
    assert ["renormalisation" in m["reason"] for m in stats["near_misses"]] == [True]


def swiglu_weights(seed=0, inter=8):
    torch.manual_seed(seed)
    return [(torch.randn(inter, H) * 0.3, torch.randn(inter, H) * 0.3, torch.randn(H, inter) * 0.3)
            for _ in range(E)]


def expert_loop(x, scores, experts, skip=None):
    """Experts applied to every token, weighted per token with where(ids == e, w, 0); ids from a top-k."""
    weights, ids = scores.softmax(-1).topk(K, dim=-1)
    out = torch.zeros_like(x)
    for e, (gate, up, down) in enumerate(experts):
        if e != skip:
            weight = torch.where(ids == e, weights, 0.0).sum(-1, keepdim=True)
            out = out + F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down) * weight
    return out


def test_expert_loop_with_where_weights(ops):
    stats, before, after = run(expert_loop, torch.randn(T, H), torch.randn(T, E), swiglu_weights(),
                               ops=ops)
    assert stats["matches"] == {fuse_moe_experts.PATTERN_LOOP: 1, fuse_moe_gating.PATTERN: 1}
    assert before["aten.mm.default"] == 3 * E and "aten.mm.default" not in after and after[FUSED] == 1
    assert after["aten.stack.default"] == 3 and after["aten.cat.default"] == 1


def test_expert_loop_missing_an_expert_is_a_near_miss(ops):
    stats, before, after = run(lambda x, s, w: expert_loop(x, s, w, skip=5), torch.randn(T, H), torch.randn(T, E),
                               swiglu_weights(), ops=ops)
    assert stats["matches"] == {fuse_moe_gating.PATTERN: 1} and FUSED not in after
    assert before["aten.mm.default"] == after["aten.mm.default"] == 3 * (E - 1)
    assert [m["reason"] for m in stats["near_misses"]] == ["the loop covers experts [0, 1, 2, 3, 4, 6, 7], not 0..6"]


def test_each_half_fuses_without_the_other(watch_pass):
    args = torch.randn(T, H), torch.randn(T, E), swiglu_weights()
    experts_only = watch_pass(fuse_moe_experts, expert_loop, *args, options={"disabled_passes": ["fuse_moe_gating"]})
    torch.testing.assert_close(experts_only.out, experts_only.ref, rtol=1e-5, atol=1e-5)
    assert experts_only.stats["matches"] == {fuse_moe_experts.PATTERN_LOOP: 1}
    assert experts_only.after[FUSED] == 1 and experts_only.after["aten.topk.default"] == 1
    gating_only = watch_pass(fuse_moe_gating, expert_loop, *args, options={"disabled_passes": ["fuse_moe_experts"]})
    torch.testing.assert_close(gating_only.out, gating_only.ref, rtol=1e-5, atol=1e-5)
    assert gating_only.stats["matches"] == {fuse_moe_gating.PATTERN: 1}
    assert gating_only.after[GATING] == 1 and FUSED not in gating_only.after
    assert gating_only.after["aten.mm.default"] == 3 * E


def test_transformers_grouped_mm_experts(ops):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=H, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, head_dim=8, num_experts=E, num_experts_per_tok=K,
                                         moe_intermediate_size=8, norm_topk_prob=True)
    block = transformers.AutoModelForCausalLM.from_config(config).model.layers[0].mlp.eval()
    stats, before, after = run(block, torch.randn(2, 5, H), ops=ops)
    assert stats["matches"] == {fuse_moe_experts.PATTERN_GROUPED: 1, fuse_moe_gating.PATTERN: 1}
    assert before["transformers.grouped_mm_fallback.default"] == 2 and before["aten.sort.default"] == 1
    assert after[FUSED] == 1 and after[GATING] == 1
    assert not {"transformers.grouped_mm_fallback.default", "aten.sort.default", "aten.histc.default"} & set(after)


def test_nothing_to_fuse_is_unchanged(ops):
    def not_moe(x, w):
        values, idx = F.relu(x @ w.t()).topk(K, dim=-1)
        return F.linear(F.silu(x @ w.t()) * (x @ w.t()), w.t()) + values.sum(), idx

    stats, before, after = run(not_moe, torch.randn(T, H), torch.randn(E, H), ops=ops)
    assert stats == {"matches": {}, "near_misses": []} and before == after


def test_reference_model_prefill_and_decode():
    torch.manual_seed(0)
    model = HybridLM(tiny_config()).eval()
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False}))
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    eager_cache, compiled_cache = model.new_cache(2), model.new_cache(2)
    token_e = token_c = ids
    with torch.no_grad():
        for _ in range(3):
            ref, out = model(token_e, eager_cache), compiled(token_c, compiled_cache)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            token_e, token_c = ref[:, -1:].argmax(-1), out[:, -1:].argmax(-1)
    moe_layers = sum(1 for i in range(model.config.num_layers) if i >= model.config.first_k_dense_replace)
    assert len(backend.reports) == 2
    for report in backend.reports:
        assert report.fused_ops["moe_gating_top_k"] == moe_layers and report.fused_ops["fused_moe"] == moe_layers
        for name in (fuse_moe_experts.NAME, fuse_moe_gating.NAME):
            assert next(p["stats"] for p in report.passes if p["name"] == name)["near_misses"] == []


def index_add_experts(x, router, gate, up, down, tokens="expand"):
    """Every expert on every token over stacked weights; each routed slot's row weighted and index_add-ed back onto
    its token (`tokens` spells the token of a slot; "repeat" names the wrong one, slot mod T)."""
    weights, ids = (x @ router.t()).softmax(-1).topk(K, dim=-1)
    xs = x.unsqueeze(0).expand(E, -1, -1)
    outs = torch.bmm(F.silu(torch.bmm(xs, gate.transpose(1, 2))) * torch.bmm(xs, up.transpose(1, 2)),
                     down.transpose(1, 2))
    t = x.shape[0]
    slot_tokens = {"expand": lambda: torch.arange(t).unsqueeze(1).expand(t, K).reshape(-1),
                   "floor": lambda: torch.arange(t * K) // K,
                   "repeat": lambda: torch.arange(t).repeat(K)}[tokens]()
    rows = weights.reshape(-1, 1) * outs[ids.reshape(-1), slot_tokens]
    return torch.zeros_like(x).index_add(0, slot_tokens, rows)


def stacked_swiglu(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, H, generator=g), torch.randn(E, 8, H, generator=g) * 0.3,
            torch.randn(E, 8, H, generator=g) * 0.3, torch.randn(E, H, 8, generator=g) * 0.3)


@pytest.mark.parametrize("tokens", ["expand", "floor"])
def test_dense_experts_combined_by_index_add(ops, tokens):
    stats, before, after = run(lambda x, *w: index_add_experts(x, *w, tokens=tokens), torch.randn(T, H),
                               *stacked_swiglu(), ops=ops)
    assert stats["matches"] == {fuse_moe_experts.PATTERN_INDEX_ADD: 1, fuse_moe_gating.PATTERN: 1}
    assert before["aten.index_add.default"] == 1 and before["aten.bmm.default"] == 3
    assert after[FUSED] == 1 and not {"aten.index_add.default", "aten.bmm.default"} & set(after)


def test_index_add_onto_other_tokens_than_the_slots_does_not_fuse(ops):
    stats, before, after = run(lambda x, *w: index_add_experts(x, *w, tokens="repeat"), torch.randn(T, H),
                               *stacked_swiglu(), ops=ops)
    assert FUSED not in after and before["aten.index_add.default"] == after["aten.index_add.default"] == 1
    assert [m["reason"] for m in stats["near_misses"]] == [
        "the rows are not added onto the tokens of their routed slots (tok = slot // k)"]

"""Tests of the reference hybrid model (npu_graph.models): cache consistency, KDA core, paging, AttnRes, MoE
routing, torch.compile tracing, and the demo-sized configs."""
import dataclasses
import time

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from npu_graph.models.attn_res import AttnRes
from npu_graph.models.cache import HybridCache
from npu_graph.models.hybrid import CONFIGS, HybridConfig, HybridLM, generate_greedy
from npu_graph.models.kda import kda_core
from npu_graph.models.moe import DeepSeekMoE, MoEGate


def make_model(seed: int = 0, **overrides: object) -> HybridLM:
    """Tiny model with random AttnRes queries (zeros would make every residual a plain mean)."""
    torch.manual_seed(seed)
    model = HybridLM(dataclasses.replace(HybridConfig.named("tiny"), **overrides)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, AttnRes):
                module.query.normal_(std=0.5)
    return model


def random_ids(model: HybridLM, batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=generator)


@torch.no_grad()
def incremental_logits(model: HybridLM, ids: torch.Tensor, cache: HybridCache, splits: list[int]) -> torch.Tensor:
    """Prefill in pieces ending at each of `splits`, then decode the remaining tokens one at a time."""
    logits, start = [], 0
    for end in [*splits, *range(splits[-1] + 1, ids.shape[1] + 1)]:
        logits.append(model(ids[:, start:end], cache))
        start = end
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("index_topk", [256, 16], ids=["topk-covers-context", "sparse-topk"])
def test_prefill_then_decode_matches_full_prefill(index_topk: int) -> None:
    model = make_model(index_topk=index_topk)
    ids = random_ids(model, batch=2, length=90)
    with torch.no_grad():
        full = model(ids, model.new_cache(2))
    cache = model.new_cache(2)
    stepped = incremental_logits(model, ids, cache, splits=[70, 80])
    torch.testing.assert_close(stepped, full, atol=2e-4, rtol=1e-4)
    assert cache.lengths.tolist() == [90, 90]


def test_sparse_selection_changes_the_output() -> None:
    ids = random_ids(make_model(), batch=1, length=60)
    with torch.no_grad():
        dense = make_model(index_topk=256)(ids)
        sparse = make_model(index_topk=16)(ids)
    torch.testing.assert_close(sparse[:, :16], dense[:, :16], atol=1e-5, rtol=1e-5)
    assert (sparse[:, 16:] - dense[:, 16:]).abs().max() > 1e-3


def test_prefill_is_causal() -> None:
    model = make_model(index_topk=256)
    ids = random_ids(model, batch=1, length=48)
    changed = ids.clone()
    changed[:, 30:] = (changed[:, 30:] + 1) % model.config.vocab_size
    with torch.no_grad():
        before, after = model(ids), model(changed)
    torch.testing.assert_close(after[:, :30], before[:, :30], atol=1e-5, rtol=1e-5)
    assert (after[:, 30:] - before[:, 30:]).abs().max() > 1e-3


def literal_kda(q, k, v, g, beta, scale, state):
    """S_t = (I - b k k^T) Diag(exp g_t) S_{t-1} + b k v^T ; o_t = S_t^T q_t * scale, one matrix at a time."""
    out = torch.zeros(*q.shape[:-1], v.shape[-1])
    state = state.clone()
    eye = torch.eye(k.shape[-1])
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            s = state[b, h]
            for t in range(q.shape[1]):
                kt, bt = k[b, t, h].unsqueeze(1), beta[b, t, h]
                s = (eye - bt * kt @ kt.T) @ torch.diag(g[b, t, h].exp()) @ s + bt * kt @ v[b, t, h].unsqueeze(0)
                out[b, t, h] = s.T @ q[b, t, h] * scale
            state[b, h] = s
    return out, state


def kda_inputs(batch=2, seq=100, heads=2, dim_k=16, dim_v=8, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q = torch.nn.functional.normalize(randn(batch, seq, heads, dim_k), dim=-1)
    k = torch.nn.functional.normalize(randn(batch, seq, heads, dim_k), dim=-1)
    v = randn(batch, seq, heads, dim_v)
    g = -torch.rand(batch, seq, heads, dim_k, generator=generator) * 3.0
    beta = torch.rand(batch, seq, heads, generator=generator)
    return q, k, v, g, beta, 0.1 * randn(batch, heads, dim_k, dim_v)


def test_kda_chunked_matches_step_recurrence() -> None:
    q, k, v, g, beta, state0 = kda_inputs()
    chunked, chunked_state = kda_core(q, k, v, g, beta, scale=0.25, initial_state=state0, output_final_state=True)
    state, steps = state0, []
    for t in range(q.shape[1]):
        o, state = kda_core(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1],
                            scale=0.25, initial_state=state, output_final_state=True)
        steps.append(o)
    torch.testing.assert_close(chunked, torch.cat(steps, dim=1), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(chunked_state, state, atol=1e-5, rtol=1e-4)
    assert kda_core(q, k, v, g, beta, scale=0.25)[1] is None


def test_kda_core_matches_literal_recurrence() -> None:
    q, k, v, g, beta, state0 = kda_inputs(batch=1, seq=70, heads=1)
    expected, expected_state = literal_kda(q, k, v, g, beta, 0.25, state0)
    o, state = kda_core(q, k, v, g, beta, scale=0.25, initial_state=state0, output_final_state=True)
    torch.testing.assert_close(o, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-4)


def test_paged_cache_reads_back_what_was_written() -> None:
    cache = HybridCache(HybridConfig.named("tiny"), batch_size=3)
    assert not torch.equal(cache.block_table.flatten(), torch.arange(cache.block_table.numel(), dtype=torch.int32))
    paged = cache.layers[0].latent
    contiguous = torch.zeros(3, cache.capacity, paged.shape[-1])
    for start, end in [(0, 37), (37, 38), (38, 100)]:
        positions = cache.positions(end - start)
        rows = torch.randn(3, end - start, paged.shape[-1])
        cache.write(paged, positions, rows.unsqueeze(2))
        contiguous[:, start:end] = rows
        cache.advance_(end - start)
    torch.testing.assert_close(cache.read_all(paged), contiguous, atol=0, rtol=0)
    picked = torch.tensor([[0, 99, 17], [5, 5, 64], [98, 1, 2]])
    torch.testing.assert_close(cache.read_rows(paged, picked), contiguous.gather(
        1, picked.unsqueeze(-1).expand(-1, -1, paged.shape[-1])), atol=0, rtol=0)


def test_model_output_does_not_depend_on_block_placement() -> None:
    model = make_model()
    ids = random_ids(model, batch=2, length=40)
    contiguous = model.new_cache(2)
    contiguous.block_table = torch.arange(contiguous.block_table.numel(), dtype=torch.int32).view(2, -1)
    shuffled = [HybridCache(model.config, 2, seed=seed) for seed in (1, 2)]
    results = [incremental_logits(model, ids, cache, splits=[36]) for cache in [contiguous, *shuffled]]
    for result in results[1:]:
        torch.testing.assert_close(result, results[0], atol=1e-6, rtol=1e-6)


def test_attn_res_with_zero_query_is_the_mean() -> None:
    sources = [torch.randn(2, 5, 16) * scale for scale in (1.0, 3.0, 0.5)]
    res = AttnRes(16)
    torch.testing.assert_close(res(sources), torch.stack(sources).mean(0))
    with torch.no_grad():
        res.query.normal_()
    mixed = res(sources)
    assert (mixed - torch.stack(sources).mean(0)).abs().max() > 1e-3
    same = [sources[0]] * 3
    torch.testing.assert_close(res(same), sources[0])


def test_moe_gate_selects_within_top_groups() -> None:
    config = HybridConfig.named("tiny")
    torch.manual_seed(0)
    gate = MoEGate(config)
    torch.nn.init.normal_(gate.weight)
    gate.e_score_correction_bias.normal_(std=0.3)
    x = torch.randn(64, config.hidden_size)
    weights, ids = gate(x)
    scores = torch.sigmoid(x @ gate.weight.T)
    biased = scores + gate.e_score_correction_bias
    per_group = config.n_routed_experts // config.n_group
    for token in range(x.shape[0]):
        group_scores = biased[token].view(config.n_group, per_group).topk(2).values.sum(-1)
        top_groups = set(group_scores.topk(config.topk_group).indices.tolist())
        allowed = [e for e in range(config.n_routed_experts) if e // per_group in top_groups]
        expected = sorted(allowed, key=lambda e: -biased[token, e].item())[:config.num_experts_per_tok]
        assert set(ids[token].tolist()) == set(expected)
    expected_weights = scores.gather(1, ids)
    expected_weights = expected_weights / expected_weights.sum(-1, keepdim=True) * config.routed_scaling_factor
    torch.testing.assert_close(weights, expected_weights)


def test_moe_loop_equals_sparse_dispatch() -> None:
    config = HybridConfig.named("tiny")
    torch.manual_seed(0)
    moe = DeepSeekMoE(config)
    torch.nn.init.normal_(moe.gate.weight)
    x = torch.randn(2, 5, config.hidden_size)
    tokens = x.view(-1, config.hidden_size)
    weights, ids = moe.gate(tokens)
    expected = torch.stack([
        sum(w * moe.experts[e](t) for w, e in zip(weights[i], ids[i].tolist(), strict=True))
        + moe.shared_experts(t) for i, t in enumerate(tokens)])
    torch.testing.assert_close(moe(x), expected.view_as(x), atol=1e-5, rtol=1e-5)


def test_compiled_prefill_and_decode_match_eager_without_recompiling() -> None:
    torch._dynamo.reset()
    model = make_model()
    ids = random_ids(model, batch=2, length=24)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    eager_cache, compiled_cache = model.new_cache(2), model.new_cache(2)
    with torch.no_grad():
        expected = model(ids, eager_cache)
        torch.testing.assert_close(compiled(ids, compiled_cache), expected, atol=1e-5, rtol=1e-5)
        assert counter.frame_count == 1
        token = expected[:, -1].argmax(-1, keepdim=True)
        for _ in range(3):
            expected = model(token, eager_cache)
            torch.testing.assert_close(compiled(token, compiled_cache), expected, atol=1e-5, rtol=1e-5)
            token = expected[:, -1].argmax(-1, keepdim=True)
    assert counter.frame_count == 2, "one graph for prefill and one for every decode step"
    assert compiled_cache.lengths.tolist() == [27, 27]
    torch._dynamo.reset()


def test_generate_greedy_continues_the_prompt() -> None:
    model = make_model()
    ids = random_ids(model, batch=2, length=20)
    tokens = generate_greedy(model, ids, steps=4, cache=model.new_cache(2))
    assert tokens.shape == (2, 4)
    with torch.no_grad():
        logits = model(torch.cat([ids, tokens[:, :-1]], dim=1))
    assert torch.equal(logits[:, 19:].argmax(-1), tokens)


def test_named_configs_are_copies_and_validated() -> None:
    assert set(CONFIGS) == {"tiny", "small", "ctx16k", "stdlib", "stdlib-mtp"}
    assert HybridConfig.named("stdlib-mtp").mtp_layers == 1 and not HybridConfig.named("stdlib").mtp_layers
    tiny = HybridConfig.named("tiny")
    tiny.layer_types.append("dsa")
    assert len(HybridConfig.named("tiny").layer_types) == 4
    assert HybridConfig.named("ctx16k").max_context >= 16384 and HybridConfig.named("ctx16k").index_topk == 2048
    with pytest.raises(ValueError, match="unknown HybridConfig"):
        HybridConfig.named("huge")
    with pytest.raises(ValueError, match="multiple of block_size"):
        dataclasses.replace(HybridConfig.named("tiny"), max_context=100)


def decode_step_seconds(name: str, context: int) -> float:
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named(name)).eval()
    cache = model.new_cache(1)
    cache.fill_synthetic_(context)
    token = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        start = time.perf_counter()
        logits = model(token, cache)
        seconds = time.perf_counter() - start
    assert logits.shape == (1, 1, model.config.vocab_size) and torch.isfinite(logits).all()
    assert cache.lengths.tolist() == [context + 1]
    return seconds


def test_small_config_decodes_at_4k_context() -> None:
    decode_step_seconds("small", 4096)


@pytest.mark.slow
def test_ctx16k_decode_step_is_well_under_a_second() -> None:
    assert min(decode_step_seconds("ctx16k", 16384) for _ in range(3)) < 1.0


@pytest.mark.slow
def test_small_config_prefills_4k_then_decodes() -> None:
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named("small")).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 4096))
    tokens = generate_greedy(model, ids, steps=2, cache=model.new_cache(1))
    assert tokens.shape == (1, 2)

"""quantize: the DSA policy puts MXFP8 on the indexer and FP8 block-128 on the KV read by sparse attention, only
where the policy (mode + fine-grained keys) says, reads a stored FP8 cache directly, and reports it all."""
import copy
import dataclasses

import pytest
import torch

from npu_graph.config import CompilerConfig, ConfigError
from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.passes import quantize
from npu_graph.quant_policy import QuantPolicy, resolve_policy

FP8 = torch.float8_e4m3fn


def policy(options: dict) -> QuantPolicy:
    return resolve_policy(CompilerConfig.from_options(options).quant)


def test_policy_modes_and_overrides() -> None:
    assert not policy({}).active
    assert policy({"quant": "dsa"}) == QuantPolicy("mxfp8", "fp8_block128", "fp32")
    assert policy({"quant": "dsa", "quant.kv": "none"}) == QuantPolicy("mxfp8", "none", "fp32")
    assert policy({"quant.kv": "fp8_block128", "quant.scale_fmt": "ue8m0"}) == \
        QuantPolicy("none", "fp8_block128", "ue8m0")


@pytest.mark.parametrize("options,valid", [({"quant": "fp8"}, "'dsa'"), ({"quant.kv": "int8"}, "fp8_block128"),
                                           ({"nz": "on"}, "'off'")])
def test_bad_quant_and_layout_values_list_the_valid_ones(options: dict, valid: str) -> None:
    with pytest.raises(ConfigError, match=valid):
        CompilerConfig.from_options(options)


def reference_model() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(dataclasses.replace(HybridConfig.named("tiny"), kv_lora_rank=128)).eval()


def compile_prefill(watch_pass, options: dict, kv_dtype: torch.dtype = torch.float32):
    model = reference_model()
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    return watch_pass(quantize, lambda i: model(i, model.new_cache(1, kv_dtype=kv_dtype)), ids,
                      options={"strict": True, **options})


def compile_decode(watch_pass, options: dict, kv_dtype: torch.dtype, index_dtype: torch.dtype | None = None):
    """One decode step compiled after an eager prefill (the cache is copied so both runs see the same one)."""
    model = reference_model()
    ids = torch.randint(0, 256, (1, 25), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(1, kv_dtype=kv_dtype, index_dtype=index_dtype)
    with torch.no_grad():
        model(ids[:, :24], cache)
    snapshot = copy.deepcopy(cache)

    def step(token: torch.Tensor) -> torch.Tensor:
        state = copy.deepcopy(snapshot)
        return model(token, state)

    return watch_pass(quantize, step, ids[:, 24:], options={"strict": True, **options})


def added(result, op: str) -> int:
    return result.after[f"ascend_dsa.{op}.default"] - result.before[f"ascend_dsa.{op}.default"]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


def test_quant_none_changes_nothing(watch_pass) -> None:
    result = compile_prefill(watch_pass, {})
    assert result.before == result.after
    assert "quantized" not in result.report.to_json()
    torch.testing.assert_close(result.out, result.ref, atol=1e-4, rtol=1e-4)


def test_dsa_policy_on_float_cache_quantizes_per_call(watch_pass) -> None:
    result = compile_prefill(watch_pass, {"quant": "dsa"})
    assert added(result, "dynamic_mx_quant") == 4          # query and key of both indexers
    assert added(result, "dynamic_block_quant") == 2       # one latent (key = value) per sparse attention
    tensors = result.report.to_json()["quantized"]["tensors"]
    assert {(t["op"], t["tensor"], t["where"]) for t in tensors} == {
        ("lightning_indexer", "query", "per call"), ("lightning_indexer", "key", "per call"),
        ("sparse_flash_attention", "key", "per call"), ("sparse_flash_attention", "value", "per call")}
    assert 0.9 < cosine(result.out, result.ref) < 1.0


def test_fine_grained_key_turns_kv_quant_off(watch_pass) -> None:
    result = compile_prefill(watch_pass, {"quant": "dsa", "quant.kv": "none"})
    assert added(result, "dynamic_mx_quant") == 4
    assert added(result, "dynamic_block_quant") == 0
    assert {t["op"] for t in result.report.to_json()["quantized"]["tensors"]} == {"lightning_indexer"}


def test_stored_fp8_cache_is_read_directly(watch_pass) -> None:
    result = compile_decode(watch_pass, {"quant": "dsa"}, kv_dtype=FP8)
    assert result.after["ascend_dsa.dequant_mx.default"] == 0
    assert result.after["ascend_dsa.dequant_block.default"] == 0
    assert result.before["ascend_dsa.dequant_block.default"] > 0
    assert added(result, "dynamic_mx_quant") == 2          # only the queries; keys are stored MXFP8
    wheres = {(t["tensor"], t["where"]) for t in result.report.to_json()["quantized"]["tensors"]}
    assert ("key", "stored cache") in wheres and ("value", "stored cache") in wheres
    assert ("key_rope", "stored cache") in wheres          # the FP8 RoPE key with its per-token scales
    assert cosine(result.out, result.ref) > 0.999          # the eager model reads the same FP8 cache


INT8_INDEXER = {"quant": "dsa", "quant.indexer": "int8"}


def test_int8_indexer_policy_quantizes_query_and_key_per_token(watch_pass) -> None:
    result = compile_prefill(watch_pass, INT8_INDEXER)
    assert added(result, "dynamic_mx_quant") == 0
    assert added(result, "dynamic_block_quant") == 4 + 2    # indexers' query and key, one latent per attention
    tensors = result.report.to_json()["quantized"]["tensors"]
    indexer = [t for t in tensors if t["op"] == "lightning_indexer"]
    assert len(indexer) == 4 and all(t["format"] == "int8_per_token" and t["scale"] == "fp32" for t in indexer)
    assert 0.9 < cosine(result.out, result.ref) < 1.0


def test_stored_int8_indexer_cache_is_read_directly(watch_pass) -> None:
    result = compile_decode(watch_pass, INT8_INDEXER, kv_dtype=FP8, index_dtype=torch.int8)
    assert result.after["ascend_dsa.dequant_block.default"] == 0
    assert added(result, "dynamic_block_quant") == 2        # only the queries; keys are stored int8
    indexer = {(t["tensor"], t["where"], t["format"]) for t in result.report.to_json()["quantized"]["tensors"]
               if t["op"] == "lightning_indexer"}
    assert indexer == {("query", "per call", "int8_per_token"), ("key", "stored cache", "int8_per_token")}
    assert cosine(result.out, result.ref) > 0.999           # the eager model reads the same int8 keys


def test_mxfp8_policy_on_an_int8_indexer_cache_requantizes_the_keys(watch_pass) -> None:
    result = compile_decode(watch_pass, {"quant": "dsa"}, kv_dtype=FP8, index_dtype=torch.int8)
    assert added(result, "dynamic_mx_quant") == 4           # the stored int8 keys are not MXFP8: quantized per call
    assert cosine(result.out, result.ref) > 0.99


def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """DSA indexer top-k written out (head dim 16: not a whole MX group)."""
    scores = torch.einsum("bthd,bsd->bths", q, k).relu()
    return (scores * w.unsqueeze(-1)).sum(dim=2).topk(4, dim=-1).indices


def test_head_dim_below_a_group_is_zero_padded(watch_pass) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, w = torch.randn(1, 8, 4, 16, generator=gen), torch.randn(1, 12, 16, generator=gen), \
        torch.rand(1, 8, 4, generator=gen)
    result = watch_pass(quantize, indexer_scores, q, k, w, options={"quant": "dsa"})
    tensors = result.report.to_json()["quantized"]["tensors"]
    assert [t.get("padded_from") for t in tensors] == [16, 16]
    assert added(result, "dynamic_mx_quant") == 2
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(result.out[0], result.ref[0]))
    assert overlap / result.ref[0].numel() >= 0.75


def test_int8_indexer_needs_no_padding(watch_pass) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, w = torch.randn(1, 8, 4, 16, generator=gen), torch.randn(1, 12, 16, generator=gen), \
        torch.rand(1, 8, 4, generator=gen)
    result = watch_pass(quantize, indexer_scores, q, k, w, options={"quant.indexer": "int8"})
    tensors = result.report.to_json()["quantized"]["tensors"]
    assert [(t["group"], t.get("padded_from")) for t in tensors] == [(16, None), (16, None)]
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(result.out[0], result.ref[0]))
    assert overlap / result.ref[0].numel() >= 0.9

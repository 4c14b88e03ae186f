"""The reference model's FP8 paged cache (kv_dtype=float8_e4m3fn): storage formats, round trips, bytes per
token, and that the model runs on it close to the float cache."""
import dataclasses

import pytest
import torch

from npu_graph.models.cache import DSALayerCache, HybridCache
from npu_graph.models.hybrid import HybridConfig, HybridLM

FP8 = torch.float8_e4m3fn


def fp8_config() -> HybridConfig:
    """The tiny config with a latent of one whole 128-value tile (tiny's 32 has none)."""
    return dataclasses.replace(HybridConfig.named("tiny"), kv_lora_rank=128)


def dsa_layer(cache: HybridCache) -> DSALayerCache:
    return next(layer for layer in cache.layers if isinstance(layer, DSALayerCache))


def test_fp8_cache_stores_codes_and_scales() -> None:
    layer = dsa_layer(HybridCache(fp8_config(), batch_size=1, kv_dtype=FP8))
    assert (layer.latent.dtype, layer.latent_scale.dtype, layer.latent_scale.shape[-1]) == (FP8, torch.float32, 1)
    assert (layer.index_k.dtype, layer.index_k_scale.dtype, layer.index_k_scale.shape[-1]) == (FP8, torch.uint8, 1)
    assert (layer.k_rope.dtype, layer.k_rope_scale.dtype, layer.k_rope_scale.shape[-1]) == (FP8, torch.float32, 1)


# e4m3 rounds to 3 mantissa bits (relative error <= 2^-4); MX's power-of-two scale puts a group's max in
# [256, 512), above e4m3's 448, so the largest values may also saturate (relative error < 2^-3)
@pytest.mark.parametrize("part,tolerance", [("latent", 2.0 ** -4), ("k_rope", 2.0 ** -4), ("index_k", 2.0 ** -3)])
def test_fp8_cache_round_trip(part: str, tolerance: float) -> None:
    cache = HybridCache(fp8_config(), batch_size=2, kv_dtype=FP8)
    layer = dsa_layer(cache)
    paged, scale = getattr(layer, part), getattr(layer, f"{part}_scale")
    values = torch.randn(2, 5, 1, paged.shape[-1], generator=torch.Generator().manual_seed(0))
    positions = torch.arange(3, 8).expand(2, 5)
    cache.write(paged, positions, values, scale)
    back = cache.read_rows(paged, positions, scale=scale)
    error = (back - values.squeeze(2)).abs()
    assert bool((error <= tolerance * values.squeeze(2).abs() + 1e-2).all())
    full = cache.read_all(paged, scale=scale)
    torch.testing.assert_close(full[:, 3:8], back)


def test_fp8_cache_bytes_per_token() -> None:
    config = HybridConfig.named("small")
    fp8 = HybridCache(config, 1, kv_dtype=FP8).bytes_per_token()
    bf16 = HybridCache(config, 1, kv_dtype=torch.bfloat16).bytes_per_token()
    assert fp8["latent"] / bf16["latent"] <= 0.52
    assert fp8["index_k"] / bf16["index_k"] <= 0.52
    assert fp8["k_rope"] == bf16["k_rope"] // 2 + 4        # FP8 codes and one fp32 scale
    assert sum(fp8.values()) / sum(bf16.values()) <= 0.52


def test_fp8_cache_needs_whole_tiles() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        HybridCache(HybridConfig.named("tiny"), 1, kv_dtype=FP8)


def test_model_on_fp8_cache_stays_close() -> None:
    torch.manual_seed(0)
    model = HybridLM(fp8_config()).eval()
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids, model.new_cache(1))
        out = model(ids, model.new_cache(1, kv_dtype=FP8))
    cosine = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0)
    assert 0.9 < cosine < 1.0

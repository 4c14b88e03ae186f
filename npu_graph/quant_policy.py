"""The hierarchical quantization policy of DeepSeek sparse attention, resolved from `CompilerConfig.quant`.

`quant="dsa"` is the policy DeepSeek-V3.2 ships with:
- projections stay in the model's dtype (BF16 in the released model: its lossless representation);
- the lightning indexer scores MXFP8 query and key (float8_e4m3fn, one E8M0 scale per 32 values along D);
  `quant.indexer="int8"` scores per-token int8 query and key instead (one fp32 scale per token and head, over all D
  values; `ascend_dsa.dynamic_block_quant` with dst_type=int8): the form of Ascend's quantized lightning indexer on
  Atlas A2/A3, whose cube units multiply int8 and have no fp8, at the same bytes per key as MXFP8 (D + 4), and a
  closer top-k to the unquantized indexer's (int8 keeps 7 bits of every value, e4m3 3 of the mantissa);
- the KV cache that sparse attention reads is FP8 (e4m3) with one fp32 scale per token, head and 128 values;
  a cache that stores its RoPE key in FP8 too (one fp32 scale per token over the rope dim: the reference model's
  FP8 cache does) hands it to sparse attention as stored.
`quant="none"` quantizes nothing. `quant.indexer` ("none" | "mxfp8" | "int8"), `quant.kv` ("none" | "fp8_block128") and
`quant.scale_fmt` ("fp32" | "ue8m0", the KV scales) override the mode part by part.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

INDEXER_FORMATS = ("none", "mxfp8", "int8")
KV_FORMATS = ("none", "fp8_block128")
MX_GROUP = 32
KV_TILE = 128
_MODE_DEFAULTS = {"none": ("none", "none"), "dsa": ("mxfp8", "fp8_block128")}

EXPECTED_ERROR = (
    "e4m3 keeps 3 mantissa bits: each quantized value is within 2^-4 of itself relative (round to nearest), "
    "values far below their group's max lose more (subnormals). Measured on the reference model with random "
    "weights (small config, `ascend-dsa bench quant`): indexer top-K recall 0.999; sparse attention alone, FP8 "
    "vs float KV on the same inputs, output cosine >= 0.9996; final logits cosine 0.988 vs quant='none', all "
    "of it from the FP8 KV (a BF16 cache alone gives 0.9996 and still changes the greedy tokens after 2 steps: "
    "this random-weight model amplifies small perturbations; trained weights are expected to amplify less).")


@dataclass(frozen=True)
class QuantPolicy:
    """What the quantize pass does: the indexer's format, the KV format and the KV scale format."""

    indexer: str = "none"
    kv: str = "none"
    scale_fmt: str = "fp32"

    @property
    def active(self) -> bool:
        return self.indexer != "none" or self.kv != "none"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def resolve_policy(quant: Any) -> QuantPolicy:
    """The policy of a QuantConfig (mode, then the fine-grained keys that are set)."""
    indexer, kv = _MODE_DEFAULTS[quant.mode]
    return QuantPolicy(indexer=quant.indexer or indexer, kv=quant.kv or kv, scale_fmt=quant.scale_fmt)


def indexer_entry(node_name: str, tensor: str, where: str, padded_from: int | None = None,
                  form: str = "mxfp8", depth: int = MX_GROUP) -> dict[str, Any]:
    """One `quantized` record of an indexer operand: MXFP8, or int8 with one fp32 scale per row of `depth` values."""
    entry = {"op": "lightning_indexer", "node": node_name, "tensor": tensor, "format": "mxfp8_e4m3",
             "group": MX_GROUP, "scale": "e8m0", "where": where}
    if form == "int8":
        entry.update({"format": "int8_per_token", "group": depth, "scale": "fp32"})
    if padded_from is not None:
        entry["padded_from"] = padded_from
    return entry


def kv_entry(node_name: str, tensor: str, where: str, scale_fmt: str, padded_from: int | None = None,
             group: int = KV_TILE) -> dict[str, Any]:
    """One `quantized` record of an FP8 KV operand: block-128 key and value, or a RoPE key with one scale per
    token (`group`: its rope dim)."""
    form = "fp8_e4m3_block128" if group == KV_TILE else f"fp8_e4m3_block{group}"
    entry = {"op": "sparse_flash_attention", "node": node_name, "tensor": tensor, "format": form,
             "group": group, "scale": scale_fmt, "where": where}
    if padded_from is not None:
        entry["padded_from"] = padded_from
    return entry

"""Argument checks of `ascend_dsa::sparse_flash_attention` (kernels/sparse_attention/sparse_flash_attention.py): ranks,
shapes, dtypes and options (nothing that reads tensor data, so the fake runs them too), and the one check on the data,
that sparse_indices holds no entry below -1."""
import math

import torch
from torch import Tensor

from npu_graph.kernels.checks import (
    once_per_signature,
    require,
    require_choice,
    require_dtype,
    require_positive,
    require_rank,
    require_same,
)
from npu_graph.kernels.indexer.checks import ScaleForm, check_fp8_scale, check_key_layout, check_lengths

OP = "sparse_flash_attention"
LAYOUTS_QUERY = ("BSND",)
LAYOUTS_KV = ("BSND", "PA_BSND")
SPARSE_MODES = (0, 3)
FP8 = torch.float8_e4m3fn
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KV_DTYPES = (*FLOAT_DTYPES, FP8)
INDEX_DTYPES = (torch.int32, torch.int64)
KV_TILE = 128             # values of a token that share one fp8 scale
KV_SCALES = ScaleForm(KV_TILE, (torch.float32,), f"fp32, one scale per token and {KV_TILE} values", "Dl")


def check_scale(scale_value: float) -> None:
    """scale_value multiplies the query; a NaN or infinite one would make every logit non-finite."""
    if not math.isfinite(scale_value):
        raise ValueError(f"{OP}: `scale_value` must be a finite number (got {scale_value}); the usual value is "
                         f"1 / sqrt(head dim)")


def _check_rope(query: Tensor, key: Tensor, query_rope: Tensor | None, key_rope: Tensor | None,
                key_rope_scale: Tensor | None) -> None:
    require((query_rope is None) == (key_rope is None),
            f"{OP}: `query_rope` and `key_rope` go together; pass both or neither")
    if query_rope is None:
        require(key_rope_scale is None, f"{OP}: `key_rope_scale` is only used with a float8_e4m3fn `key_rope`")
        return
    require_rank(OP, "query_rope", query_rope, 4)
    require_dtype(OP, "query_rope", query_rope, FLOAT_DTYPES)
    require_rank(OP, "key_rope", key_rope, 4)
    require_dtype(OP, "key_rope", key_rope, KV_DTYPES)
    rope_scales = ScaleForm(key_rope.shape[3], (torch.float32,), "fp32, one scale per token over Dr", "Dr")
    check_fp8_scale(OP, key_rope, key_rope_scale, "key_rope", "key_rope_scale", rope_scales)
    require_same(OP, "leading dims [B,S1,N1] of `query_rope` and `query`", tuple(query_rope.shape[:3]),
                 tuple(query.shape[:3]))
    require_same(OP, "leading dims of `key_rope` and `key`", tuple(key_rope.shape[:3]), tuple(key.shape[:3]))
    require_same(OP, "rope dim Dr of `query_rope` and `key_rope`", query_rope.shape[3], key_rope.shape[3])


@once_per_signature
def check_static(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, block_table: Tensor | None,
                  actual_seq_lengths_query: Tensor | None, actual_seq_lengths_kv: Tensor | None,
                  query_rope: Tensor | None, key_rope: Tensor | None, key_scale: Tensor | None,
                  value_scale: Tensor | None, sparse_block_size: int, layout_query: str, layout_kv: str,
                  sparse_mode: int, key_rope_scale: Tensor | None = None) -> None:
    """Checks on ranks, shapes, dtypes and options: nothing here reads tensor data (safe in the fake), so a
    signature that passed once is not checked again (checks.once_per_signature)."""
    require_choice(OP, "layout_query", layout_query, LAYOUTS_QUERY)
    require_choice(OP, "layout_kv", layout_kv, LAYOUTS_KV)
    require_choice(OP, "sparse_mode", sparse_mode, SPARSE_MODES)
    require_positive(OP, "sparse_block_size", sparse_block_size)
    for name, t in (("query", query), ("key", key), ("value", value), ("sparse_indices", sparse_indices)):
        require_rank(OP, name, t, 4)
    require_dtype(OP, "query", query, FLOAT_DTYPES)
    require_dtype(OP, "key", key, KV_DTYPES)
    require_same(OP, "dtypes of `value` and `key`", value.dtype, key.dtype)
    require_dtype(OP, "sparse_indices", sparse_indices, INDEX_DTYPES)
    batch, s1 = query.shape[:2]
    require(key.shape[2] == 1, f"{OP}: `key` must have one head (N2=1) in dim 2, got shape {tuple(key.shape)}")
    require_same(OP, "head dim Dl of `query` and `key`", query.shape[3], key.shape[3])
    require(query.shape[3] > 0, f"{OP}: the head dim Dl of `query` and `key` must be > 0, got shape "
                                f"{tuple(query.shape)}")
    require_same(OP, "shapes of `value` and `key`", tuple(value.shape), tuple(key.shape))
    require_same(OP, "leading dims of `sparse_indices` and [B,S1,1] of `query`", tuple(sparse_indices.shape[:3]),
                 (batch, s1, 1))
    require(sparse_indices.shape[3] > 0, f"{OP}: `sparse_indices` selects no keys (last dim is 0)")
    _check_rope(query, key, query_rope, key_rope, key_rope_scale)
    check_fp8_scale(OP, key, key_scale, "key", "key_scale", KV_SCALES)
    check_fp8_scale(OP, value, value_scale, "value", "value_scale", KV_SCALES)
    check_key_layout(OP, key, block_table, layout_kv, "layout_kv", batch)
    check_lengths(OP, actual_seq_lengths_query, "actual_seq_lengths_query", batch)
    check_lengths(OP, actual_seq_lengths_kv, "actual_seq_lengths_kv", batch)


def check_data(sparse_indices: Tensor) -> None:
    if sparse_indices.numel():
        low = int(sparse_indices.min())
        require(low >= -1, f"{OP}: `sparse_indices` holds {low}; entries must be >= 0, or -1 to skip")

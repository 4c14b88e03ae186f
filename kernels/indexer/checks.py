"""Argument checks of `ascend_dsa::lightning_indexer` (kernels/indexer/lightning_indexer.py): ranks, shapes, dtypes and
options (nothing that reads tensor data, so the fake runs them too), the actual sequence lengths and block table
read off the data, and which keys each query row sees. The sparse flash attention op shares the layout checks."""
import math
from dataclasses import dataclass

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

OP = "lightning_indexer"
LAYOUTS_QUERY = ("BSND",)
LAYOUTS_KEY = ("BSND", "PA_BSND")
SPARSE_MODES = (0, 3)
MX_GROUP = 32
FP8 = torch.float8_e4m3fn
INT8 = torch.int8
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8, INT8)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
INDEX_DTYPES = (torch.int32, torch.int64)
INT32_MAX = 2 ** 31 - 1     # the largest position the int32 `sparse_indices` hold


@dataclass(frozen=True)
class ScaleForm:
    """How a quantized tensor's scales are laid out: one per `group` values of the last dim (`dim`); group None:
    one per row (the whole last dim)."""

    group: int | None
    dtypes: tuple[torch.dtype, ...]
    what: str
    dim: str


MX_SCALES = ScaleForm(MX_GROUP, SCALE_DTYPES, f"MXFP8, one e8m0 scale per {MX_GROUP} values along D", "D")
INT8_ROW_SCALES = ScaleForm(None, (torch.float32,), "int8, one fp32 scale per row of D values (per token and head)",
                            "D")


def check_fp8_scale(op: str, x: Tensor, scale: Tensor | None, x_name: str, scale_name: str, form: ScaleForm,
                    int8_form: ScaleForm | None = None) -> None:
    """`scale` is given exactly when `x` is quantized: float8_e4m3fn with `form`'s dtype and shape, or (where the op
    takes them) int8 with `int8_form`'s."""
    quantized = {FP8: form} if int8_form is None else {FP8: form, INT8: int8_form}
    if x.dtype not in quantized:
        names = " or ".join(str(t).removeprefix("torch.") for t in quantized)
        require(scale is None, f"{op}: `{scale_name}` is only used with a {names} `{x_name}`; `{x_name}` is {x.dtype}")
        return
    form = quantized[x.dtype]
    kind = str(x.dtype).removeprefix("torch.")
    require(scale is not None, f"{op}: {kind} `{x_name}` needs `{scale_name}` ({form.what})")
    require_dtype(op, scale_name, scale, form.dtypes)
    d = x.shape[-1]
    group = d if form.group is None else form.group
    require(d % group == 0, f"{op}: head dim {form.dim}={d} of {kind} `{x_name}` is not a multiple of {group}")
    want = (*x.shape[:-1], d // group)
    shown = "1" if form.group is None else f"{form.dim}/{form.group}"
    require_same(op, f"shape of `{scale_name}` and the expected [..., {shown}]", tuple(scale.shape), want)


def check_lengths(op: str, lengths: Tensor | None, name: str, batch: int) -> None:
    if lengths is not None:
        require_rank(op, name, lengths, 1)
        require_dtype(op, name, lengths, INDEX_DTYPES)
        require_same(op, f"length of `{name}` and the batch size B", lengths.shape[0], batch)


def check_key_layout(op: str, key: Tensor, block_table: Tensor | None, layout: str, layout_name: str,
                     batch: int) -> None:
    """A BSND key has the query's batch size and no block table; a paged one needs a [B, max_blocks] table."""
    if layout == "BSND":
        require(block_table is None, f"{op}: `block_table` is only used with {layout_name}='PA_BSND'")
        require_same(op, "batch size of `key` and `query`", key.shape[0], batch)
        return
    require(block_table is not None, f"{op}: {layout_name}='PA_BSND' needs `block_table` [B, max_blocks]")
    require_rank(op, "block_table", block_table, 2)
    require_dtype(op, "block_table", block_table, INDEX_DTYPES)
    require_same(op, "rows of `block_table` and the batch size B", block_table.shape[0], batch)


MAX_SPARSE_COUNT = 1 << 20       # positions a query may select: a million-token context, dense


@once_per_signature
def check_static(query: Tensor, key: Tensor, weights: Tensor, actual_seq_lengths_query: Tensor | None,
                  actual_seq_lengths_key: Tensor | None, block_table: Tensor | None, query_scale: Tensor | None,
                  key_scale: Tensor | None, layout_query: str, layout_key: str, sparse_count: int,
                  sparse_mode: int) -> None:
    """Checks on ranks, shapes, dtypes and options: nothing here reads tensor data (safe in the fake), so a
    signature that passed once is not checked again (checks.once_per_signature)."""
    require_choice(OP, "layout_query", layout_query, LAYOUTS_QUERY)
    require_choice(OP, "layout_key", layout_key, LAYOUTS_KEY)
    require_choice(OP, "sparse_mode", sparse_mode, SPARSE_MODES)
    require_positive(OP, "sparse_count", sparse_count)
    require(sparse_count <= MAX_SPARSE_COUNT,
            f"{OP}: `sparse_count`={sparse_count} is more than the {MAX_SPARSE_COUNT} positions a query may select "
            f"(the outputs hold [B, S1, 1, sparse_count]; DeepSeek-V3.2 selects 2048)")
    for name, t, rank in (("query", query, 4), ("key", key, 4), ("weights", weights, 3)):
        require_rank(OP, name, t, rank)
    require_dtype(OP, "query", query, INPUT_DTYPES)
    require_dtype(OP, "key", key, INPUT_DTYPES)
    require_dtype(OP, "weights", weights, WEIGHT_DTYPES)
    batch, s1, n1, d = query.shape
    require(key.shape[2] == 1, f"{OP}: `key` must have one head (N2=1) in dim 2, got shape {tuple(key.shape)}")
    require_same(OP, "head dim D of `query` and `key`", d, key.shape[3])
    require(n1 > 0 and d > 0, f"{OP}: `query` needs at least one head and a head dim > 0, got shape "
                              f"{tuple(query.shape)} [B,S1,N1,D]")
    require_same(OP, "shape of `weights` and [B,S1,N1] of `query`", tuple(weights.shape), (batch, s1, n1))
    check_fp8_scale(OP, query, query_scale, "query", "query_scale", MX_SCALES, INT8_ROW_SCALES)
    check_fp8_scale(OP, key, key_scale, "key", "key_scale", MX_SCALES, INT8_ROW_SCALES)
    check_key_layout(OP, key, block_table, layout_key, "layout_key", batch)
    positions = key.shape[1] if block_table is None else block_table.shape[1] * key.shape[1]
    require(positions <= INT32_MAX, f"{OP}: `key` holds {positions} positions; the int32 `sparse_indices` it "
                                    f"returns address at most {INT32_MAX}")
    check_lengths(OP, actual_seq_lengths_query, "actual_seq_lengths_query", batch)
    check_lengths(OP, actual_seq_lengths_key, "actual_seq_lengths_key", batch)


def _lengths(op: str, lengths: Tensor | None, default: int, name: str, holder: str) -> list[int]:
    if lengths is None:
        return []
    values = [int(v) for v in lengths.tolist()]
    for b, v in enumerate(values):
        require(0 <= v <= default, f"{op}: `{name}`[{b}]={v} is outside [0, {default}], the positions {holder}")
    return values


def _check_block_table(op: str, block_table: Tensor, block_size: int, num_blocks: int,
                       key_lengths: list[int]) -> None:
    """Every block that holds one of the first actual_seq_lengths_key[b] tokens must exist in the cache."""
    for b, length in enumerate(key_lengths):
        used = block_table[b, :math.ceil(length / block_size)]
        if used.numel():
            low, high = int(used.min()), int(used.max())
            require(low >= 0 and high < num_blocks,
                    f"{op}: `block_table`[{b}] refers to block {low if low < 0 else high}, outside the "
                    f"{num_blocks} blocks of the paged `key`")


def sequence_lengths(op: str, query: Tensor, key: Tensor, block_table: Tensor | None, query_lengths: Tensor | None,
                     key_lengths: Tensor | None, key_lengths_name: str) -> tuple[list[int], list[int]]:
    """Actual query and key lengths per batch as Python ints (defaults filled in), range-checked, and the
    block table checked against them."""
    batch, s1 = query.shape[:2]
    capacity = key.shape[1] if block_table is None else block_table.shape[1] * key.shape[1]
    holder = "of `key`" if block_table is None else \
        f"`block_table` addresses ({block_table.shape[1]} blocks of {key.shape[1]})"
    lq = _lengths(op, query_lengths, s1, "actual_seq_lengths_query", "of `query`") or [s1] * batch
    lk = _lengths(op, key_lengths, capacity, key_lengths_name, holder) or [capacity] * batch
    if block_table is not None:
        _check_block_table(op, block_table, key.shape[1], key.shape[0], lk)
    return lq, lk


def visible_keys(row: int, query_len: int, key_len: int, sparse_mode: int) -> int:
    """Number of leading key positions query row `row` may attend to."""
    if sparse_mode == 0:
        return key_len
    return min(max(key_len - query_len + row + 1, 0), key_len)

"""`ascend_dsa::causal_lengths` — turns a model's attention mask into the per-batch sequence lengths that
the fused DSA operators take (`actual_seq_lengths_query`, `actual_seq_lengths_key`, sparse_mode=3).

The fused operators express causality as "query t of batch b sees keys s <= S2_b − S1_b + t". A fusion pass
cannot prove from the graph that an arbitrary mask has that shape, so it keeps the mask computation and
calls this op, which checks at run time that the mask really is right-down causal (visible keys of every
query are a prefix, growing by one key per query) and raises otherwise — never silently wrong.

Bool and fp32 additive masks are checked by a native kernel (kernels/native/causal_lengths.c: one pass over
the mask, ~170 -> ~10 us for a decode row of 16K keys between memory-bound layers); other masks, and every
mask without the native library, by the torch expression.
"""
from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from npu_graph.kernels import dispatch, native, native_prototypes
from npu_graph.kernels.checks import FusedPreconditionError, require, require_rank

_ADDITIVE_MASKED = -1e30      # also in native/causal_lengths.c
NATIVE_SOURCE = "causal_lengths"
_NATIVE_KINDS = {(torch.bool, False): 0, (torch.float32, True): 1}     # the masks the native check reads
_NOT_CAUSAL = ("causal_lengths: the attention mask is not right-down causal (each query must see a prefix of the "
               "keys, one more than the query before it)")
_NOT_ADDITIVE = ("causal_lengths: an additive mask must hold 0 (visible) or a very large negative value (masked); "
                 "this one holds other values, so it cannot become sequence lengths")


def _visible(mask: Tensor, additive: bool) -> Tensor:
    if not additive:
        return mask.bool()
    visible = mask == 0
    if not bool((visible | (mask <= _ADDITIVE_MASKED)).all()):
        raise FusedPreconditionError(_NOT_ADDITIVE)
    return visible


@functools.cache
def _typed(lib: ctypes.CDLL) -> ctypes._CFuncPtr:
    return native_prototypes.typed(lib, NATIVE_SOURCE, "cl_lengths")


def _native_lengths(mask: Tensor, additive: bool) -> Tensor | None:
    """lengths_k from the native check (module docstring) for a bool or fp32 additive CPU mask, else None; raises
    as the torch path does."""
    kind = _NATIVE_KINDS.get((mask.dtype, additive))
    loaded = native.load(NATIVE_SOURCE) if kind is not None and mask.is_cpu else None
    if not loaded:
        return None
    lengths_k = torch.empty(mask.shape[0], dtype=torch.int32, device="cpu")
    status = _typed(loaded.lib)(mask.data_ptr(), kind, *mask.shape, *mask.stride(), lengths_k.data_ptr())
    if status == 2:
        raise FusedPreconditionError(_NOT_ADDITIVE)
    if status == 1:
        raise FusedPreconditionError(_NOT_CAUSAL)
    return lengths_k


def reference_causal_lengths(mask: Tensor, additive: bool = False) -> tuple[Tensor, Tensor]:
    """Readable reference: count visible keys row by row and check the causal staircase."""
    visible = _visible(mask, additive)
    batch, rows = visible.shape[:2]
    lengths_q, lengths_k = [], []
    for b in range(batch):
        counts = [int(visible[b, t].sum()) for t in range(rows)]
        for t in range(rows):
            prefix = bool(visible[b, t, :counts[t]].all())
            if not (prefix and counts[t] == max(counts[-1] - (rows - 1 - t), 0)):
                raise FusedPreconditionError(f"causal_lengths: mask row {t} of batch {b} is not right-down causal")
        lengths_q.append(rows)
        lengths_k.append(counts[-1])
    return torch.tensor(lengths_q, dtype=torch.int32), torch.tensor(lengths_k, dtype=torch.int32)


INT32_MAX = 2 ** 31 - 1


def _check_sizes(mask: Tensor) -> None:
    """The lengths are int32 (as the fused operators take them): a mask whose rows or keys do not fit is refused
    before anything is counted (an expanded mask can be that large without the memory)."""
    require_rank("causal_lengths", "mask", mask, 3)
    for name, size in (("queries (dim 1)", mask.shape[1]), ("keys (dim 2)", mask.shape[2])):
        require(size <= INT32_MAX, f"causal_lengths: the mask has {size} {name}; the int32 sequence lengths hold "
                                   f"at most {INT32_MAX}")


@torch.library.custom_op("ascend_dsa::causal_lengths", mutates_args=())
def causal_lengths(mask: Tensor, additive: bool = False) -> tuple[Tensor, Tensor]:
    """mask [B, S1, S2] (bool: True = visible, or additive float: 0 = visible) -> (actual_seq_lengths_query,
    actual_seq_lengths_key), int32 [B]. Raises ValueError when the mask is not right-down causal."""
    _check_sizes(mask)

    def run() -> tuple[Tensor, Tensor]:
        return _causal_lengths_cpu(mask, additive)

    cls = native_class(mask, additive)
    return run() if cls is None else dispatch.run("causal_lengths", NATIVE_SOURCE, cls, run, dispatch.torch_path(run))


def native_class(mask: Tensor, additive: bool = False) -> tuple | None:
    """The shape class kernels/dispatch.py measures for a mask the native check reads, else None."""
    if (mask.dtype, additive) not in _NATIVE_KINDS or not mask.is_cpu or not native.load(NATIVE_SOURCE):
        return None
    return dispatch.shape_class(mask.dtype, *mask.shape)


def _causal_lengths_cpu(mask: Tensor, additive: bool) -> tuple[Tensor, Tensor]:
    lengths_k = _native_lengths(mask, additive)
    if lengths_k is not None:
        return torch.full((mask.shape[0],), mask.shape[1], dtype=torch.int32), lengths_k
    visible = _visible(mask, additive)
    counts = visible.sum(-1, dtype=torch.int32)
    rows = visible.shape[1]
    if rows == 0:                      # no query rows: nothing sees a key (as the native kernel says)
        empty = torch.zeros(visible.shape[0], dtype=torch.int32, device=mask.device)
        return empty, empty.clone()
    keys = torch.arange(visible.shape[2], device=mask.device)
    staircase = counts[:, -1:] - (rows - 1 - torch.arange(rows, device=mask.device, dtype=torch.int32))
    staircase = staircase.clamp_min(0)
    prefix = visible == (keys < counts.unsqueeze(-1))
    if not (bool(prefix.all()) and bool((counts == staircase).all())):
        raise FusedPreconditionError(_NOT_CAUSAL)
    lengths_q = torch.full((visible.shape[0],), rows, dtype=torch.int32, device=mask.device)
    return lengths_q, counts[:, -1].contiguous()


@causal_lengths.register_fake
def _causal_lengths_fake(mask: Tensor, additive: bool = False) -> tuple[Tensor, Tensor]:
    require_rank("causal_lengths", "mask", mask, 3)
    if all(isinstance(size, int) for size in mask.shape):
        _check_sizes(mask)
    batch = mask.shape[0]
    return mask.new_empty((batch,), dtype=torch.int32), mask.new_empty((batch,), dtype=torch.int32)

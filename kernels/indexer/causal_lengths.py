"""`ascend_dsa::causal_lengths` — turns a model's attention mask into the per-batch sequence lengths that
the fused DSA operators take (`actual_seq_lengths_query`, `actual_seq_lengths_key`, sparse_mode=3), and with
`windows=True` the first visible key of each batch row (`key_starts`: a left-padded batch).

The fused operators express causality as "query t of batch b sees keys key_starts_b <= s <= S2_b − S1_b + t"
(key_starts 0 without windows). A fusion pass cannot prove from the graph that an arbitrary mask has that shape,
so it keeps the mask computation and calls this op, which checks at run time that the mask really is right-down
causal (the visible keys of every query are one run from the row's start, growing by one key per query; a
query whose run ends at or before the start sees nothing: the padding of a left-padded prompt) and raises
otherwise — never silently wrong. Without `windows` a start other than 0 is refused the same way.

Non-finite values. In an additive mask -inf is masked, like any value <= -1e30. NaN and +inf are refused, with
the FusedPreconditionError every mask the lengths cannot express gets (the backend then runs the graph eagerly,
where NaN in the mask makes the attention of its query row NaN, as the model's own code gives it).

Bool and fp32 additive masks are checked by a native kernel (kernels/native/causal_lengths.c: one pass over
the mask, ~170 -> ~10 us for a decode row of 16K keys between memory-bound layers); other masks, and every
mask without the native library, by the torch expression.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch
from torch import Tensor

from npu_graph.kernels.checks import FusedPreconditionError, require, require_rank, tensors_given
from npu_graph.kernels.native import call_plans, dispatch
from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import prototypes as native_prototypes

_ADDITIVE_MASKED = -1e30      # also in native/causal_lengths.c
NATIVE_SOURCE = "causal_lengths"
_NATIVE_KINDS = {(torch.bool, False): 0, (torch.float32, True): 1}     # the masks the native check reads
_NOT_CAUSAL = ("causal_lengths: the attention mask is not right-down causal (each query must see a prefix of the "
               "keys, one more than the query before it)")
_NOT_ADDITIVE = ("causal_lengths: the additive `mask` must hold 0 (visible) or a value <= -1e30, -inf included "
                 "(masked); this one holds another value (NaN, +inf or a finite value in between), so it cannot "
                 "become sequence lengths")


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


def _native_plan(mask: Tensor, additive: bool, windows: bool) -> Callable[[Tensor], tuple[Tensor, ...]] | None:
    """The native check (module docstring) for masks of this signature (bool or fp32 additive, CPU), its sizes and
    strides fixed, or None where it does not apply. The plan returns the op's three outputs and raises as the
    torch path does."""
    kind = _NATIVE_KINDS.get((mask.dtype, additive))
    loaded = native.load(NATIVE_SOURCE) if kind is not None and mask.is_cpu else None
    if not loaded:
        return None
    fn, flag, batch, rows = _typed(loaded.lib), int(windows), mask.shape[0], mask.shape[1]
    sizes = (*mask.shape, *mask.stride())

    def plan(mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        lengths_k = torch.empty(batch, dtype=torch.int32, device="cpu")
        starts = torch.empty(batch, dtype=torch.int32, device="cpu")
        status = fn(mask.data_ptr(), kind, flag, *sizes, lengths_k.data_ptr(), starts.data_ptr())
        if status == 2:
            raise FusedPreconditionError(_NOT_ADDITIVE)
        if status == 1:
            raise FusedPreconditionError(_NOT_CAUSAL)
        return torch.full((batch,), rows, dtype=torch.int32), lengths_k, starts

    return plan


def _native_lengths(mask: Tensor, additive: bool, windows: bool) -> tuple[Tensor, Tensor] | None:
    """(lengths_k, key_starts) from the native check for a bool or fp32 additive CPU mask, else None; raises as
    the torch path does."""
    plan = _native_plan(mask, additive, windows)
    return None if plan is None else plan(mask)[1:]


def reference_causal_lengths(mask: Tensor, additive: bool = False, windows: bool = False
                             ) -> tuple[Tensor, Tensor, Tensor]:
    """Readable reference: find each batch row's start and limit on its last query row, then check every row."""
    visible = _visible(mask, additive)
    batch, rows, keys = visible.shape
    lengths_q, lengths_k, starts = [], [], []
    for b in range(batch):
        last = [s for s in range(keys) if visible[b, rows - 1, s]] if rows else []
        start, limit = (last[0], last[-1] + 1) if last else (0, 0)
        for t in range(rows):
            end = limit - (rows - 1 - t)
            want = [s for s in range(keys) if start <= s < end]
            got = [s for s in range(keys) if visible[b, t, s]]
            if got != want or (start and not windows):
                raise FusedPreconditionError(f"causal_lengths: mask row {t} of batch {b} is not right-down causal")
        lengths_q.append(rows)
        lengths_k.append(limit)
        starts.append(start)
    return tuple(torch.tensor(x, dtype=torch.int32) for x in (lengths_q, lengths_k, starts))


INT32_MAX = 2 ** 31 - 1


def _check_sizes(mask: Tensor) -> None:
    """The lengths are int32 (as the fused operators take them): a mask whose rows or keys do not fit is refused
    before anything is counted (an expanded mask can be that large without the memory)."""
    require_rank("causal_lengths", "mask", mask, 3)
    for name, size in (("queries (dim 1)", mask.shape[1]), ("keys (dim 2)", mask.shape[2])):
        require(size <= INT32_MAX, f"causal_lengths: the mask has {size} {name}; the int32 sequence lengths hold "
                                   f"at most {INT32_MAX}")


_PLANS = call_plans.Plans("causal_lengths")


@torch.library.custom_op("ascend_dsa::causal_lengths", mutates_args=())
@tensors_given
def causal_lengths(mask: Tensor, additive: bool = False, windows: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """mask [B, S1, S2] (bool: True = visible, or additive float: 0 = visible) -> (actual_seq_lengths_query,
    actual_seq_lengths_key, key_starts), int32 [B]. Raises FusedPreconditionError when the mask is not right-down
    causal (from key 0, or from each row's key_starts with `windows`). The size checks and the path are decided
    once per signature (kernels/native/call_plans); the mask's data is checked at every call."""
    signature = (mask.shape, mask.stride(), mask.dtype, mask.is_cpu, additive, windows)
    plan = _PLANS.get(signature)
    if plan is not None:
        return plan(mask)
    _check_sizes(mask)

    def run() -> tuple[Tensor, Tensor, Tensor]:
        return _causal_lengths_cpu(mask, additive, windows)

    cls = native_class(mask, additive)
    if cls is None:
        _PLANS.put(signature, functools.partial(_torch_lengths, additive=additive, windows=windows))
        return run()
    result = dispatch.run("causal_lengths", NATIVE_SOURCE, cls, run, dispatch.torch_path(run))
    impl = dispatch.known("causal_lengths", cls)
    native_plan = _native_plan(mask, additive, windows) if impl == "native" else None
    if impl is not None:
        _PLANS.put(signature, native_plan or functools.partial(_torch_lengths, additive=additive, windows=windows))
    return result


def native_class(mask: Tensor, additive: bool = False, windows: bool = False) -> tuple | None:
    """The shape class kernels/native/dispatch.py measures for a mask the native check reads, else None."""
    if (mask.dtype, additive) not in _NATIVE_KINDS or not mask.is_cpu or not native.load(NATIVE_SOURCE):
        return None
    return dispatch.shape_class(mask.dtype, *mask.shape)


def _causal_lengths_cpu(mask: Tensor, additive: bool, windows: bool) -> tuple[Tensor, Tensor, Tensor]:
    plan = _native_plan(mask, additive, windows)
    return plan(mask) if plan is not None else _torch_lengths(mask, additive, windows)


def _torch_lengths(mask: Tensor, additive: bool, windows: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The torch expression of the check and the lengths."""
    visible = _visible(mask, additive)
    batch, rows, keys = visible.shape
    if rows == 0:                      # no query rows: nothing sees a key (as the native kernel says)
        empty = torch.zeros(batch, dtype=torch.int32, device=mask.device)
        return empty, empty.clone(), empty.clone()
    last = visible[:, -1]
    count = last.sum(-1, dtype=torch.int32)
    first = last.int().argmax(-1) if keys else torch.zeros(batch, dtype=torch.int64, device=mask.device)
    start = torch.where(count > 0, first, 0).to(torch.int32)
    if not windows and bool(start.any()):
        raise FusedPreconditionError(_NOT_CAUSAL)
    limit = start + count
    ends = limit[:, None] - (rows - 1 - torch.arange(rows, device=mask.device, dtype=torch.int32))   # [B, S1]
    positions = torch.arange(keys, device=mask.device)
    expected = (positions >= start[:, None, None]) & (positions < ends[..., None])
    if not bool((visible == expected).all()):
        raise FusedPreconditionError(_NOT_CAUSAL)
    lengths_q = torch.full((batch,), rows, dtype=torch.int32, device=mask.device)
    return lengths_q, limit, start


@causal_lengths.register_fake
def _causal_lengths_fake(mask: Tensor, additive: bool = False, windows: bool = False
                         ) -> tuple[Tensor, Tensor, Tensor]:
    require_rank("causal_lengths", "mask", mask, 3)
    if all(isinstance(size, int) for size in mask.shape):
        _check_sizes(mask)
    batch = mask.shape[0]
    return tuple(mask.new_empty((batch,), dtype=torch.int32) for _ in range(3))

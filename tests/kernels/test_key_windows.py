"""key_starts (a left-padded batch) in lightning_indexer and sparse_flash_attention, through the native and the
torch paths: padding keys are never selected nor attended, the other keys give what the definition gives over
the keys from each row's start, rows without padding are unchanged, and what cannot be honoured is refused."""
import pytest
import torch
from native_paths import native_and_torch

from npu_graph.kernels.checks import FusedPreconditionError
from npu_graph.kernels.indexer import native as lightning_indexer_native
from npu_graph.kernels.sparse_attention import native as sfa_native
from npu_graph.kernels.sparse_attention.reference import reference_sparse_flash_attention

OPS = torch.ops.ascend_dsa
indexer_path = native_and_torch(lightning_indexer_native.NATIVE_SOURCE)
sfa_path = native_and_torch(sfa_native.NATIVE_SOURCE)


def indexer_inputs(batch: int, rows: int, keys: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, rows, 8, 32, generator=generator), torch.randn(batch, keys, 1, 32, generator=generator),
            torch.rand(batch, rows, 8, generator=generator))


def scored_window(q, k, w, b, t, start, limit, count) -> set[int]:
    """The definition over keys [start, limit): the positions of the `count` best scores."""
    score = (torch.relu(q[b, t] @ k[b, start:limit, 0].T) * w[b, t, :, None]).sum(0)
    return {start + int(i) for i in score.topk(min(count, limit - start)).indices}


@pytest.mark.parametrize("rows", [1, 4])
def test_indexer_selects_only_keys_from_each_rows_start(rows, indexer_path):
    q, k, w = indexer_inputs(3, rows, 40)
    starts, lengths = torch.tensor([0, 7, 30], dtype=torch.int32), torch.tensor([40, 40, 38], dtype=torch.int32)
    lengths_q = torch.full((3,), rows, dtype=torch.int32)
    idx, _ = OPS.lightning_indexer(q, k, w, lengths_q, lengths, None, None, None, starts, sparse_count=16)
    for b in range(3):
        for t in range(rows):
            limit = int(lengths[b]) - (rows - 1 - t)
            got = {int(i) for i in idx[b, t, 0] if i >= 0}
            assert got == scored_window(q, k, w, b, t, int(starts[b]), limit, 16), (b, t)


def test_indexer_rows_without_padding_match_the_call_without_starts(indexer_path):
    q, k, w = indexer_inputs(2, 1, 64, seed=1)
    zeros = torch.zeros(2, dtype=torch.int32)
    with_starts = OPS.lightning_indexer(q, k, w, None, None, None, None, None, zeros, sparse_count=8)
    plain = OPS.lightning_indexer(q, k, w, sparse_count=8)
    assert all(torch.equal(a, b) for a, b in zip(with_starts, plain, strict=True))


def test_indexer_refuses_starts_with_a_paged_cache():
    q, _, w = indexer_inputs(1, 1, 32)
    cache, table = torch.randn(4, 16, 1, 32), torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(FusedPreconditionError, match="paged cache"):
        OPS.lightning_indexer(q, cache, w, None, torch.tensor([32], dtype=torch.int32), table, None, None,
                              torch.tensor([3], dtype=torch.int32), layout_key="PA_BSND", sparse_count=8)


def test_sparse_attention_skips_positions_before_each_rows_start(sfa_path):
    generator = torch.Generator().manual_seed(2)
    q, kv = torch.randn(2, 1, 4, 32, generator=generator), torch.randn(2, 24, 1, 32, generator=generator)
    indices = torch.tensor([[[[1, 5, 9, 20, -1]]], [[[2, 3, 12, 23, 0]]]], dtype=torch.int32)
    starts = torch.tensor([6, 3], dtype=torch.int32)
    got = OPS.sparse_flash_attention(q, kv, kv, indices, 0.5, None, None, None, None, None, None, None, starts)[0]
    kept = torch.tensor([[[[-1, -1, 9, 20, -1]]], [[[-1, 3, 12, 23, -1]]]], dtype=torch.int32)
    want = reference_sparse_flash_attention(q, kv, kv, kept, 0.5)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_starts_are_refused():
    q, k, w = indexer_inputs(2, 1, 16)
    with pytest.raises(ValueError, match="key_starts must be an integer tensor"):
        OPS.lightning_indexer(q, k, w, None, None, None, None, None, torch.zeros(3, dtype=torch.int32))

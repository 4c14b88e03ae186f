"""ascend_dsa::lightning_indexer decode rows through the native scoring kernel (kernels/native/lightning_indexer.c)
at every instruction-set level this CPU can execute (bf16 dot products at avx512_bf16, the fp32 micro-kernel
below it), and through the torch path (ASCEND_DSA_NATIVE=0), all against the fp32 reference: BSND and paged keys,
fp32/bf16/fp16, head counts that are not multiples of the vector width, causal and plain masks, fewer visible keys
than sparse_count, sequence lengths; the raw scores against brute force."""
import pytest
import torch
from native_paths import native_and_torch
from test_lightning_indexer import assert_same_topk, make_inputs, scores_of, to_paged

from npu_graph.kernels.indexer import lightning_indexer as li
from npu_graph.kernels.indexer import native as li_native
from npu_graph.kernels.native import loader as native

OP = torch.ops.ascend_dsa.lightning_indexer
LOADED, WHY = native.available(li_native.NATIVE_SOURCE)
path = native_and_torch(li_native.NATIVE_SOURCE)


def check_path(path, q, key, table=None):
    scorer = li_native.row_scorer(q, key, table)
    assert (scorer is not None) == (path != "torch")


CASES = [  # batch, s1, n1, d, s2, k, sparse_mode
    (1, 1, 64, 128, 5000, 512, 3),    # DeepSeek-V3.2 indexer heads and dim
    (2, 1, 16, 64, 700, 64, 3),       # the reference model's
    (1, 3, 20, 32, 300, 50, 3),       # a few decode rows (MTP), heads beyond one vector
    (2, 2, 5, 24, 90, 20, 0),         # no mask, few heads, dim not a multiple of 16
    (1, 2, 16, 16, 10, 32, 3),        # fewer visible keys than sparse_count: -1 padding
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case, dtype, path):
    batch, s1, n1, d, s2, k, mode = case
    q, key, w = make_inputs(batch, s1, n1, d, s2, dtype, seed=s2)
    check_path(path, q, key)
    got = OP(q, key, w, sparse_count=k, sparse_mode=mode)
    assert_same_topk(got, li.reference_lightning_indexer(q, key, w, sparse_count=k, sparse_mode=mode))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 24, 128])    # 24: 16 keys cross a block (amx_bf16 copies them)
def test_paged_keys_with_lengths(dtype, block_size, path):
    q, key, w = make_inputs(2, 1, 16, 64, 1000, dtype, seed=7)
    cache, table = to_paged(key, block_size, seed=block_size)
    check_path(path, q, cache, table)
    lengths_q, lengths_k = torch.tensor([1, 1]), torch.tensor([1000, 613])
    got = OP(q, cache, w, lengths_q, lengths_k, table, layout_key="PA_BSND", sparse_count=128)
    want = li.reference_lightning_indexer(q, key, w, lengths_q, lengths_k, sparse_count=128)
    assert_same_topk(got, want)


@pytest.mark.skipif(not LOADED, reason=f"native kernel not available: {WHY}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n1", [1, 16, 33, 64])
@pytest.mark.parametrize("keys", [1, 49, 777])
def test_scores_equal_brute_force(dtype, n1, keys, isa_level):
    """The kernel's scores themselves, every key: fp32 sums of exact products, so fp32 rounding apart. Key counts
    below, across and well past one chunk of keys widened at a time (48), head counts that fill one vector, leave
    a block of heads narrower than the others, or pad the last vector."""
    q, key, w = make_inputs(1, 1, n1, 64, keys, dtype, seed=n1 + keys)
    score = li_native.row_scorer(q, key, None)(0, keys, q[0, 0], w[0, 0])
    torch.testing.assert_close(score, scores_of(q, key, w)[0, 0], rtol=1e-5, atol=1e-4)


def test_switch_off_uses_the_torch_path(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    q, key, _ = make_inputs(1, 1, 16, 64, 100, torch.bfloat16)
    assert li_native.row_scorer(q, key, None) is None


@pytest.mark.skipif(not LOADED, reason=f"native kernel not available: {WHY}")
@pytest.mark.parametrize(("n", "k"), [(16384, 2048), (1000, 1), (300, 300), (10, 32), (0, 4), (5000, 777),
                                       (64, 8), (90, 89)])     # n x (k + 1) <= 8192: sorted insertion
@pytest.mark.parametrize("values", ["distinct", "ties", "negative_and_inf", "nan_and_zeros", "close"])
def test_native_topk_equals_torch_topk(n, k, values):
    """Values equal torch.topk's (sorted, -inf pads); among equal scores the lowest positions come first (-0 and +0
    are equal); NaN ranks above +inf; a key scoring -inf is reported as -1, as a masked key is (the torch path and
    the reference do the same). `close` puts every score in one bin of the selection's first digit."""
    g = torch.Generator().manual_seed(n + k)
    scores = torch.randn(n, generator=g)
    if values == "ties":
        scores = scores.mul(3).round()
    elif values == "negative_and_inf" and n:
        scores = -scores.abs()
        scores[:: max(1, n // 7)] = float("-inf")
        scores[1 % n] = float("inf")
    elif values == "nan_and_zeros" and n:
        scores = scores.relu().mul(torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0))     # +-0 and +-x
        scores[:: max(1, n // 5)] = float("nan")
        scores[-1] = -float("nan")
    elif values == "close":
        scores = 1.0 + scores.abs().mul(1e-3).round(decimals=5)
    indices, got = li_native.select_topk(scores, k)
    take = min(n, k)
    want = scores.topk(take).values
    assert torch.equal(got[0, :take].isnan(), want.isnan())
    assert torch.equal(got[0, :take].nan_to_num(), want.nan_to_num()) and (got[0, take:] == float("-inf")).all()
    assert (indices[0, take:] == -1).all()
    rank = [(0 if v != v else 1, -v if v == v else 0.0, i) for i, v in enumerate(scores.tolist())]
    ordered = [i for *_, i in sorted(rank)][:take]
    assert indices[0, :take].tolist() == [-1 if scores[i] == float("-inf") else i for i in ordered]


@pytest.mark.skipif(not LOADED, reason=WHY)
def test_prefill_ties_are_settled_as_in_an_eager_models_masked_scores(monkeypatch):
    """Most keys score exactly 0 (every q·k < 0), a few clearly above: a prefill row with fewer positive keys than
    sparse_count is tied at the cut. The native path keeps the keys transformers' deepseek_v32 indexer keeps: topk
    over the [S, T] score matrix with the causal mask at -inf (torch.topk's choice among ties depends on the row's
    length, so settling over the visible keys alone picks others in ~1 row of 10)."""
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    g = torch.Generator().manual_seed(11)
    seq, k = 48, 8
    query = -torch.rand(1, seq, 4, 16, generator=g)
    key = torch.rand(1, seq, 1, 16, generator=g)
    key[0, torch.randperm(seq, generator=g)[:10]] *= -1                       # these score above 0
    weights = torch.rand(1, seq, 4, generator=g) + 0.5
    scores = (torch.relu(torch.einsum("bshd,btd->bsht", query, key[:, :, 0])) * weights[..., None]).sum(2)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    eager = scores.masked_fill(~causal, float("-inf")).topk(k, dim=-1)
    want = eager.indices.int().masked_fill(eager.values == float("-inf"), -1)
    got = OP(query, key, weights, sparse_count=k, sparse_mode=3)[0][:, :, 0]
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)


@pytest.mark.skipif(not LOADED, reason=WHY)
@pytest.mark.parametrize("paged", [False, True])
def test_tied_rows_of_a_batch_are_settled_over_the_layouts_keys(monkeypatch, paged):
    """Tied rows of two batches with their own lengths, keys in rows or in a paged cache, scored again by one native
    call (li_tied_scores): each is settled by topk over a row as long as the keys the layout holds (48: the rows, or
    three blocks of 16), the keys it does not see at -inf."""
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    g = torch.Generator().manual_seed(3)
    seq, k, lq, lk = 48, 8, [40, 29], [48, 33]
    query = -torch.rand(2, seq, 4, 16, generator=g)
    key = torch.rand(2, seq, 1, 16, generator=g)
    key[:, torch.randperm(seq, generator=g)[:10]] *= -1                       # these score above 0
    weights = torch.rand(2, seq, 4, generator=g) + 0.5
    lengths = torch.tensor(lq, dtype=torch.int32), torch.tensor(lk, dtype=torch.int32)
    if paged:
        cache, table = to_paged(key, 16, seed=5)
        got = OP(query, cache, weights, *lengths, table, layout_key="PA_BSND", sparse_count=k, sparse_mode=3)[0]
    else:
        got = OP(query, key, weights, *lengths, sparse_count=k, sparse_mode=3)[0]
    scores = (torch.relu(torch.einsum("bshd,btd->bsht", query, key[:, :, 0])) * weights[..., None]).sum(2)
    for b in range(2):
        for t in range(lq[b]):
            row = scores[b, t].clone()
            row[lk[b] - lq[b] + t + 1:] = float("-inf")
            want = row.topk(k)
            want = want.indices.int().masked_fill(want.values == float("-inf"), -1)
            assert torch.equal(got[b, t, 0].sort().values, want.sort().values), (b, t)


@pytest.mark.skipif(not LOADED, reason=WHY)
def test_tied_left_padded_rows_are_settled_over_the_eager_row_with_the_padding_first(monkeypatch):
    """A left-padded batch (key_starts) whose rows tie at the cut: each row is ranked as transformers' deepseek_v32
    ranks it, topk over the whole cache row with the padding and the causal future at -inf (the padding first, so
    torch.topk meets the ties where the eager model's row has them), not over the row's visible keys alone."""
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    g = torch.Generator().manual_seed(7)
    seq, k, starts = 40, 8, [0, 9, 23]
    query = -torch.rand(3, seq, 4, 16, generator=g)
    key = torch.rand(3, seq, 1, 16, generator=g)
    key[:, torch.randperm(seq, generator=g)[:6]] *= -1                        # these score above 0
    weights = torch.rand(3, seq, 4, generator=g) + 0.5
    got = OP(query, key, weights, None, None, None, None, None, torch.tensor(starts, dtype=torch.int32),
             sparse_count=k, sparse_mode=3)[0]
    scores = (torch.relu(torch.einsum("bshd,btd->bsht", query, key[:, :, 0])) * weights[..., None]).sum(2)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for b, start in enumerate(starts):
        visible = causal.clone()
        visible[:, :start] = False
        eager = scores[b].masked_fill(~visible, float("-inf")).topk(k, dim=-1)
        want = eager.indices.int().masked_fill(eager.values == float("-inf"), -1)
        for t in range(start, seq):
            assert torch.equal(got[b, t, 0].sort().values, want[t].sort().values), (b, t)

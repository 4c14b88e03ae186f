"""The indexer kernel on several threads: the keys of a row split between OpenMP threads give the very scores one
thread gives, at every instruction-set level, and two Python threads calling at once both get theirs."""
import threading

import pytest
import torch
from test_lightning_indexer import make_inputs, scores_of

from npu_graph.kernels.indexer import native as li_native
from npu_graph.kernels.native import loader as native

LOADED, WHY = native.available(li_native.NATIVE_SOURCE)
pytestmark = pytest.mark.skipif(not LOADED, reason=f"native kernel not available: {WHY}")
KEYS = 6000         # 13 chunks of 480 keys, enough work to be shared (64 heads of dim 128)


def scores(q, key, w, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return li_native.row_scorer(q, key, None)(0, KEYS, q[0, 0], w[0, 0])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_scores_equal_one_thread(dtype, isa_level):
    q, key, w = make_inputs(1, 1, 64, 128, KEYS, dtype, seed=5)
    alone = scores(q, key, w, 1)
    for threads in (2, 3):
        assert torch.equal(scores(q, key, w, threads), alone)
    torch.testing.assert_close(alone, scores_of(q, key, w)[0, 0], rtol=1e-5, atol=1e-4)


def test_two_callers_at_once():
    inputs = [make_inputs(1, 1, 64, 128, KEYS, torch.bfloat16, seed=seed) for seed in (1, 2)]
    want = [scores(*args, 1) for args in inputs]
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def call(i):
        for _ in range(20):
            got[i].append(li_native.row_scorer(inputs[i][0], inputs[i][1], None)(0, KEYS, inputs[i][0][0, 0],
                                                                                 inputs[i][2][0, 0]))
    threads = [threading.Thread(target=call, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1):
        assert len(got[i]) == 20 and all(torch.equal(g, want[i]) for g in got[i])


@pytest.mark.parametrize("case", ["random", "zero rows tied at the cut", "nan rows", "repeated rows", "few keys"])
def test_shared_selection_equals_one_thread(case, isa_level, monkeypatch, torch_threads):
    """The top-k selected across threads (order keys counted per chunk, the cut bin found from the summed counts,
    chunks split in their own stretches and joined in position order) is the one-thread selection: the same
    positions in the same order, the same values, ties at the cut settled the same way."""
    q, key, w = make_inputs(1, 1, 64, 128, KEYS, torch.bfloat16, seed=7)
    k = 2048
    if case == "zero rows tied at the cut":
        key[:, 1000:5800] = 0           # 4800 keys score exactly 0: the cut falls among them
    elif case == "nan rows":
        key[:, [5, 3000, 5999]] = float("nan")
    elif case == "repeated rows":
        key[:, 3000:] = key[:, :3000]
    elif case == "few keys":
        k = KEYS - 100
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    torch_threads(1)
    alone = torch.ops.ascend_dsa.lightning_indexer(q, key, w, sparse_count=k)
    for threads in (2, 3, 5):                  # with several threads each also counts and splits its own chunks
        torch_threads(threads)
        shared = torch.ops.ascend_dsa.lightning_indexer(q, key, w, sparse_count=k)
        assert torch.equal(shared[0], alone[0]), threads
        torch.testing.assert_close(shared[1], alone[1], rtol=0, atol=0, equal_nan=True)

"""reinplace_input_writes: cache writes become in-place when nothing reads the old contents afterwards."""
import torch

import npu_graph
from npu_graph.passes import reinplace_input_writes


def run(fn, *args):
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False}))
    eager_args = [a.clone() for a in args]
    with torch.no_grad():
        ref = fn(*eager_args)
        out = torch.compile(fn, backend=backend)(*args)
    stats = next(p["stats"] for p in backend.reports[-1].passes if p["name"] == reinplace_input_writes.NAME)
    for a, b in zip(args, eager_args):
        assert torch.equal(a, b)
    torch.testing.assert_close(out, ref)
    return stats


def test_chained_cache_writes_are_done_in_place():
    def step(cache, idx, v):
        cache.index_put_((idx,), v)
        total = cache.sum(0)
        cache.index_put_((idx + 1,), v * 2)
        return total + cache[0]

    stats = run(step, torch.zeros(10, 4), torch.tensor([2]), torch.ones(1, 4))
    assert stats == {"writes_in_place": 2, "copies_removed": 1}


def test_write_kept_functional_when_old_contents_are_read_later():
    def step(cache, idx, v):
        old = cache[0].clone()
        cache.index_put_((torch.tensor([0]),), v)
        return old * 2 + idx.sum()

    stats = run(step, torch.ones(4, 3), torch.tensor([1]), torch.full((1, 3), 5.0))
    assert stats == {}


def test_functions_without_input_writes_are_untouched():
    assert run(lambda x: x.exp(), torch.randn(3)) == {}

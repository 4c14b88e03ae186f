"""eliminate_common_subexpressions: repeated pure expressions are computed once; reads around in-place writes,
random ops and buffers filled in place are left alone; numerics unchanged."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from npu_graph.config import CompilerConfig
from npu_graph.pass_api import PassContext
from npu_graph.passes import eliminate_common_subexpressions as cse
from npu_graph.targets.description import describe

CPU = describe("cpu")   # the target description the passes read

aten = torch.ops.aten


def run_pass(fn, *args, mode="fake"):
    gm = make_fx(fn, tracing_mode=mode)(*[a.clone() for a in args])
    expected = fn(*[a.clone() for a in args])
    result = cse.run(gm, PassContext(config=CompilerConfig(), machine=CPU))
    gm.recompile()
    torch.testing.assert_close(gm(*[a.clone() for a in args]), expected)
    return gm, result.stats


def count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.target == target)


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_repeated_casts_and_views_merge(mode):
    def fn(table, pos):
        a = table.long().unsqueeze(-1) + pos.unsqueeze(-1)
        b = table.long().unsqueeze(-1) * pos.unsqueeze(-1)
        return a, b, torch.cos(pos) + torch.cos(pos)

    gm, stats = run_pass(fn, torch.arange(6, dtype=torch.int32).view(2, 3), torch.rand(2, 3), mode=mode)
    assert stats["merged"] >= 4
    assert count(gm, aten._to_copy.default) == 1 and count(gm, aten.cos.default) == 1
    assert count(gm, aten.unsqueeze.default) == 2


def test_nodes_built_from_equal_symbolic_sizes_merge():
    """sym_size of two tensors with the same symbolic length is one int: the masks built from either merge."""
    def fn(k, v):
        a, b = torch.ones(1, k.shape[0], dtype=torch.bool), torch.ones(1, v.shape[0], dtype=torch.bool)
        return a.logical_not() | b.logical_not()

    gm, _ = run_pass(fn, torch.rand(5, 2), torch.rand(5, 3), mode="symbolic")
    assert count(gm, aten.ones.default) == 1


def test_a_size_read_from_an_unused_result_is_read_earlier():
    """A symbolic size read from a tensor nothing else needs (as fusion passes read sizes) is replaced by the first
    node computing the same int, so the tensor's computation becomes dead code."""
    def fn(k, v):
        return (k * 2).softmax(0), v.reshape(k.shape[0], -1) + 1

    k, v = torch.rand(5, 3), torch.rand(5, 2)
    gm = make_fx(fn, tracing_mode="symbolic")(k, v)
    size = next(n for n in gm.graph.nodes if n.target == aten.sym_size.int)
    softmax = next(n for n in gm.graph.nodes if n.target == aten._softmax.default)
    with gm.graph.inserting_after(size):
        late = gm.graph.call_function(aten.sym_size.int, (softmax, 0))
    late.meta["val"] = size.meta["val"]
    size.replace_all_uses_with(late, delete_user_cb=lambda user: user is not late)
    output = gm.graph.output_node()
    output.args = ((output.args[0][1],),)          # the softmax itself is not returned
    gm.recompile()
    stats = cse.run(gm, PassContext(config=CompilerConfig(), machine=CPU)).stats
    gm.graph.eliminate_dead_code()
    assert stats["sym_size"] == 1 and count(gm, aten._softmax.default) == 0
    torch.testing.assert_close(gm(k, v)[0], v.reshape(5, -1) + 1)


def test_chains_merge_transitively():
    gm, _ = run_pass(lambda x: x.t().exp().sum(0) * x.t().exp().sum(0), torch.rand(3, 4))
    assert count(gm, aten.exp.default) == 1 and count(gm, aten.sum.dim_IntList) == 1


def test_reads_of_a_buffer_written_in_place_are_kept_apart():
    def fn(cache, x):
        before = cache.view(-1).sum()
        cache.view(-1).copy_(x)
        return before, cache.view(-1).sum()

    gm, stats = run_pass(fn, torch.zeros(2, 3), torch.rand(6))
    assert count(gm, aten.sum.default) == 2 and not stats


def test_buffers_filled_in_place_stay_separate():
    def fn(x):
        a = torch.zeros(3)
        b = torch.zeros(3)
        a.add_(x)
        return a, b

    gm, _ = run_pass(fn, torch.rand(3))
    assert count(gm, aten.zeros.default) == 2


def test_random_ops_and_different_constants_are_not_merged():
    gm = make_fx(lambda x: (x + torch.rand(3), x + torch.rand(3), x * 2, x * 3))(torch.rand(3))
    assert not cse.run(gm, PassContext(config=CompilerConfig(), machine=CPU)).stats
    assert count(gm, aten.rand.default) == 2


def test_writes_through_a_split_view_keep_reads_of_the_buffer_apart():
    def fn(cache, x):
        before = cache.sum()
        first, _ = cache.view(2, 6).split([3, 3], dim=1)
        first.t().mul_(x)
        return before, cache.sum()

    gm, stats = run_pass(fn, torch.ones(12), torch.rand(3, 2))
    assert count(gm, aten.sum.default) == 2 and not stats


def test_tuple_items_written_in_place_keep_their_producers_apart():
    def fn(x):
        a, _ = torch.ops.ascend_dsa.rms_norm(x, torch.ones(4))
        b, _ = torch.ops.ascend_dsa.rms_norm(x, torch.ones(4))
        a.add_(1)
        return a + b

    gm, _ = run_pass(fn, torch.rand(2, 4))
    assert count(gm, torch.ops.ascend_dsa.rms_norm.default) == 2


def test_returned_tensors_stay_distinct():
    gm = make_fx(lambda x: (torch.zeros(4), torch.zeros(4), x + 1))(torch.rand(3))
    cse.run(gm, PassContext(config=CompilerConfig(), machine=CPU))
    gm.recompile()
    a, b, _ = gm(torch.rand(3))
    assert count(gm, aten.zeros.default) == 2 and a.data_ptr() != b.data_ptr()

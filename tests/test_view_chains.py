"""npu_graph.runtime.view_chains: chains of views with static layouts become one reinterpret_tensor of the
tensor the chain starts from; results, aliasing and what is left alone."""
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from npu_graph.runtime import view_chains


def traced(fn, *inputs, mode="fake"):
    return make_fx(fn, tracing_mode=mode)(*inputs)


def calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def chain(x, y):
    a = x.view(4, 16).transpose(0, 1)[2:10].unsqueeze(0)
    b, c = torch.split(y, [3, 5], 1)
    return a * 2, b.t() + 1, c.reshape(1, -1).squeeze(0) * 3


def test_a_chain_becomes_one_view_of_its_root_with_the_same_values_and_storage():
    x, y = torch.randn(64), torch.randn(2, 8)
    gm = traced(chain, torch.randn(64), torch.randn(2, 8))
    assert view_chains.collapse(gm) > 0
    views = calls(gm, view_chains.reinterpret_tensor)
    roots = {n.args[0] for n in views}
    assert all(view_chains._view_input(r) is None and r.target is not view_chains.reinterpret_tensor for r in roots)
    assert not calls(gm, torch.ops.aten.transpose.int) and not calls(gm, torch.ops.aten.split_with_sizes.default)
    for got, want in zip(gm(x, y), chain(x, y)):
        assert torch.equal(got, want)


def test_offsets_are_relative_to_the_root_at_run_time():
    """The root at run time may itself start inside its storage (a view passed in): offsets add to its own."""
    gm = traced(lambda x: x.view(2, 8)[1, 3:7] + 0, torch.randn(16))
    view_chains.collapse(gm)
    base = torch.randn(40)
    x = base[5:21]
    assert torch.equal(gm(x), x.view(2, 8)[1, 3:7])


def test_a_returned_view_and_a_written_view_are_left_alone():
    def fn(x, y):
        out = x.view(4, 4)[1:]
        y.view(-1)[:4].add_(1.0)
        return out, y.view(2, 8)[0] * 1

    gm = traced(fn, torch.randn(16), torch.randn(16), mode="real")
    view_chains.collapse(gm)
    returned = next(iter(gm.graph.find_nodes(op="output"))).args[0][0]
    assert returned.target is torch.ops.aten.slice.Tensor
    written = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.add_.Tensor]
    assert written and written[0].args[0].target is not view_chains.reinterpret_tensor
    x, y = torch.randn(16), torch.randn(16)
    y2 = y.clone()
    got = gm(x, y)
    want = fn(x, y2)
    assert torch.equal(got[1], want[1]) and torch.equal(y, y2)


def test_symbolic_views_are_left_alone():
    gm = make_fx(lambda x: x.view(-1, 4)[:, 1:3] * 2, tracing_mode="symbolic")(torch.randn(8, 4))
    assert view_chains.collapse(gm) == 0


def test_a_copying_reshape_is_not_a_view():
    gm = traced(lambda x: x.t().reshape(-1) * 1, torch.randn(3, 4))
    view_chains.collapse(gm)
    x = torch.randn(3, 4)
    assert torch.equal(gm(x), x.t().reshape(-1))


def test_views_of_a_tensor_written_through_another_view_are_left_alone():
    """Writing through one view bumps the root's version counter; a reinterpreted sibling would not see it as
    a view does, so the whole family stays as it is."""
    def fn(x):
        x.view(4, 4)[0].add_(1.0)
        return x.view(2, 8)[1] * 1

    gm = traced(fn, torch.randn(16), mode="real")
    assert view_chains.collapse(gm) == 0

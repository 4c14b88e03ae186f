"""canonical_form: each rule gives its spelling's canonical op, the graph keeps eager's numbers, and the fake
values it leaves are those a full propagation gives (views of a replacement alias it), static and symbolic."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from npu_graph.config import CompilerConfig
from npu_graph.pass_api import PassContext
from npu_graph.passes import canonical_form
from npu_graph.passes.matching.meta_refresh import _value_signature
from npu_graph.targets.description import describe

aten = torch.ops.aten


def spellings(x, y):
    """relu, square, halves, even/odd pairs, a cast round trip, top-k flags and commuted operands, each read by
    views afterwards."""
    r = torch.clamp_min(x, 0.0).view(-1)
    sq = x.pow(2).transpose(0, 1)
    first, second = x.chunk(2, dim=-1)
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    wide = y.double().float().unsqueeze(0)
    top = torch.topk(x, 3, dim=1, sorted=False).indices.sort(-1).values
    commuted = (y * x.sum(-1, keepdim=True)) + x
    return r.sum() + sq.sum(), first[..., :1] * second, even.t() - odd.t(), wide, top, commuted


def run_canonical_form(mode):
    x, y = torch.randn(5, 8), torch.randn(5, 8)
    gm = make_fx(spellings, tracing_mode=mode)(x, y)
    result = canonical_form.run(gm, PassContext(config=CompilerConfig(), machine=describe("cpu")))
    gm.graph.lint()
    gm.recompile()
    return gm, result, (x, y)


def full_values(gm):
    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    FakeTensorProp(gm, mode=torch._guards.detect_fake_mode(inputs)).propagate_dont_convert_inputs(*inputs)
    return {n.name: _value_signature(n.meta.get("val")) for n in gm.graph.nodes if n.op != "output"}


def _storage(value):
    return value.untyped_storage()._cdata if isinstance(value, torch.Tensor) else None


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_each_spelling_becomes_its_canonical_op_with_eager_numbers(mode):
    gm, result, inputs = run_canonical_form(mode)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {"relu", "square", "pieces", "cast", "topk_flags", "operand_order"} <= set(result.stats), result.stats
    assert aten.relu.default in targets and aten.pow.Tensor_Scalar not in targets
    assert not targets & {aten.clamp_min.default, aten.split.Tensor}
    # unbind of a [.., D/2, 2] view: even/odd slices where D is known even; a symbolic D may be odd
    assert (aten.unbind.int in targets) == (mode == "symbolic")
    assert all(n.args[2:] == (-1, True, True) for n in gm.graph.nodes if n.target == aten.topk.default)
    for got, expected in zip(gm(*inputs), spellings(*inputs), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_fake_values_are_those_of_a_full_propagation(mode):
    gm, _, _ = run_canonical_form(mode)
    left = {n.name: n.meta.get("val") for n in gm.graph.nodes if n.op != "output"}
    views = [n for n in gm.graph.nodes if n.target in (aten.view.default, aten.t.default, aten.transpose.int,
                                                       aten.unsqueeze.default, aten.slice.Tensor)]
    # a view shares the storage of what it views, in the values the pass left as in a fresh propagation
    aliased = {n.name: _storage(left[n.name]) == _storage(left[n.args[0].name]) for n in views}
    assert views and all(aliased.values()), aliased
    expected = full_values(gm)
    assert {name: _value_signature(v) for name, v in left.items()} == expected

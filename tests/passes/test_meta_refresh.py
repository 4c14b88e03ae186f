"""refresh_meta with a snapshot: after a rewrite it gives every node the value a full fake-tensor propagation
gives, recomputing only the nodes the rewrite can have changed."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from npu_graph.passes.matching.meta_refresh import _value_signature, meta_snapshot, refresh_meta

aten = torch.ops.aten


def model(x, w):
    h = torch.mm(x, w)                  # [N, M]
    t = h.t().contiguous()              # [M, N], the node a rewrite replaces by a bare view
    s = t.unsqueeze(0)                  # a view of it: its strides follow its input's
    y = torch.relu(s) * 2               # elementwise ops keep their input's layout
    side = torch.tanh(x).sum()          # a branch the rewrite does not touch
    return y.sum(1), side


def traced(mode):
    return make_fx(model, tracing_mode=mode)(torch.randn(6, 4), torch.randn(4, 5))


def full_values(gm):
    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    FakeTensorProp(gm, mode=torch._guards.detect_fake_mode(inputs)).propagate_dont_convert_inputs(*inputs)
    return {n.name: _value_signature(n.meta.get("val")) for n in gm.graph.nodes}


def drop_contiguous(gm):
    """Rewrite: the transposed copy becomes the transpose itself (other strides downstream)."""
    (node,) = [n for n in gm.graph.nodes if n.target == aten.clone.default]
    node.replace_all_uses_with(node.args[0])
    gm.graph.erase_node(node)


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_incremental_refresh_equals_full_propagation(mode):
    gm = traced(mode)
    if not any(n.target == aten.clone.default for n in gm.graph.nodes):
        pytest.skip("make_fx traced contiguous() without a clone")
    before = meta_snapshot(gm)
    untouched = {n.name: n.meta["val"] for n in gm.graph.nodes if n.target in (aten.tanh.default, aten.mm.default)}
    drop_contiguous(gm)
    refresh_meta(gm, since=before)
    got = {n.name: _value_signature(n.meta.get("val")) for n in gm.graph.nodes}
    view = next(n for n in gm.graph.nodes if n.target == aten.unsqueeze.default)
    assert got[view.name][1][1] == 1                      # the view now sees the transpose's strides
    for name, value in untouched.items():                 # nodes the rewrite cannot change kept their values
        assert next(n for n in gm.graph.nodes if n.name == name).meta["val"] is value
    assert got == full_values(gm)


def test_refresh_without_snapshot_recomputes_everything():
    gm = traced("fake")
    old = {n.name: n.meta["val"] for n in gm.graph.nodes if n.op == "call_function"}
    refresh_meta(gm)
    assert all(n.meta["val"] is not old[n.name] for n in gm.graph.nodes if n.op == "call_function")

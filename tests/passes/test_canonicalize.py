"""canonicalize: each rule fires where it should, never where the copy or view is needed, and keeps
numerics; symbolic shapes are handled."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from npu_graph.config import CompilerConfig
from npu_graph.pass_api import PassContext
from npu_graph.passes import canonicalize
from npu_graph.targets.description import describe

CPU = describe("cpu")   # the target description the passes read

aten = torch.ops.aten


def run_pass(fn, *args, mode="fake"):
    gm = make_fx(fn, tracing_mode=mode)(*args)
    expected = fn(*args)
    result = canonicalize.run(gm, PassContext(config=CompilerConfig(), machine=CPU))
    gm.recompile()
    torch.testing.assert_close(gm(*args), expected)
    return gm, result.stats


def targets(gm):
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def test_noop_view_and_view_chain():
    gm, stats = run_pass(lambda x: (x.view(4, 6).view(24).view(4, 6) + 1).reshape(2, 12), torch.randn(4, 6))
    assert stats["noop_view"] >= 1 and stats["view_chain"] >= 1
    views = [n for n in gm.graph.nodes if n.target in (aten.view.default, aten.reshape.default)]
    assert len(views) == 1


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_unit_dims_fold_into_view_chains(mode):
    gm, stats = run_pass(lambda x: x.view(4, 6).unsqueeze(0).unsqueeze(-1).view(2, 12).unsqueeze(1) * 2,
                         torch.randn(24), mode=mode)
    assert stats["view_chain"] >= 2
    assert not targets(gm) & {aten.unsqueeze.default}


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_factories_no_longer_depend_on_their_template(mode):
    def fn(x, w):
        scores = x @ w  # only shapes the mask below: dead once the factory is detached
        mask = scores.new_full((x.shape[0], 3), float("-inf")).scatter(-1, torch.zeros(x.shape[0], 1).long(), 0.0)
        return mask + x.new_zeros(x.shape[0], 3) + x.new_ones((1, 3), dtype=torch.float64)

    gm, stats = run_pass(fn, torch.randn(4, 5), torch.randn(5, 6), mode=mode)
    assert stats["detached_factory"] == 3
    assert aten.mm.default not in targets(gm)
    assert not targets(gm) & {aten.new_full.default, aten.new_zeros.default, aten.new_ones.default}


def test_identity_arithmetic_removed_but_promotion_kept():
    gm, stats = run_pass(lambda x: (x * 1 + 0) / 1 - 0, torch.randn(3, 5))
    assert stats["identity_arith"] == 4 and not targets(gm) & {aten.mul.Tensor, aten.add.Tensor}
    gm, stats = run_pass(lambda x: x * 1.0, torch.arange(6))
    assert "identity_arith" not in stats and aten.mul.Tensor in targets(gm)


def test_noop_copy_removed_only_when_not_needed_for_aliasing():
    gm, stats = run_pass(lambda x: (x + 1).clone().relu(), torch.randn(4))
    assert stats["noop_copy"] == 1 and aten.clone.default not in targets(gm)
    gm, stats = run_pass(lambda x: x.clone(), torch.randn(4))
    assert "noop_copy" not in stats and aten.clone.default in targets(gm)
    gm, stats = run_pass(lambda x: (x + 1).to(torch.float64).sum(), torch.randn(4))
    assert aten._to_copy.default in targets(gm)


def test_double_transpose_and_dead_code():
    def f(x):
        unused = x.exp()  # noqa: F841
        return x.t().t() @ x.t()

    gm, stats = run_pass(f, torch.randn(3, 3))
    assert stats["double_transpose"] == 1 and stats["dead_code"] >= 1 and aten.exp.default not in targets(gm)


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_one_mask_spelled_twice_becomes_one_node(mode):
    """~~mask -> mask (bool only), mask[:, 0] of a unit dim -> squeeze, a full slice -> the tensor: the decode mask
    an indexer and sparse attention both read (DeepSeek-V3.2 writes it both ways) is then one node for CSE."""
    def fn(pos, keys):
        mask = torch.arange(keys.shape[0]).view(1, 1, -1) <= pos.view(-1, 1, 1)       # [B, 1, T]
        return aten.slice.Tensor(~~mask[:, 0], 1, 0, 2 ** 63 - 1), mask.squeeze(1), ~~pos    # a full slice

    gm, stats = run_pass(fn, torch.tensor([3]), torch.randn(7), mode=mode)
    assert stats["double_negation"] == 1 and stats["unit_select"] == 1 and stats["noop_view"] >= 1
    assert not targets(gm) & {aten.select.int, aten.logical_not.default, aten.slice.Tensor}
    assert aten.bitwise_not.default in targets(gm)            # ~~ of an int tensor is kept (int, not bool)


def test_symbolic_shapes_only_removed_when_provably_equal():
    gm, stats = run_pass(lambda x: x.reshape(x.shape[0], x.shape[1]) + x.reshape(x.shape[1], x.shape[0]).sum(),
                         torch.randn(6, 5), mode="symbolic")
    assert stats.get("noop_view", 0) == 1 and aten.view.default in targets(gm)


def test_nothing_to_do_reports_unchanged():
    gm = make_fx(lambda x: x.relu())(torch.randn(3))
    result = canonicalize.run(gm, PassContext(config=CompilerConfig(), machine=CPU))
    assert not result.changed and result.stats == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_outputs_stay_distinct_tensors(dtype):
    gm, _ = run_pass(lambda x: ((x + 1).clone(), x + 1), torch.randn(4, dtype=dtype))
    a, b = gm(torch.randn(4, dtype=dtype))
    assert a.data_ptr() != b.data_ptr()


def test_second_run_cleans_up_after_the_fusion_passes(monkeypatch):
    from npu_graph.models.hybrid import HybridConfig, HybridLM

    graphs = []
    original = canonicalize.run

    def spy(gm, ctx):
        result = original(gm, ctx)
        graphs.append((result.stats, [n for n in gm.graph.nodes if n.op == "call_function"]))
        return result

    monkeypatch.setattr(canonicalize, "run", spy)
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named("tiny")).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.compile(model, backend="ascend_dsa", options={"cache": False})(ids, model.new_cache(1))
    _, (last, nodes) = graphs
    assert last.get("view_chain", 0) > 0
    views = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
    assert not [n for n in nodes if n.target in views and getattr(n.args[0], "target", None) in views]


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_permute_chains_compose_and_unit_dim_permutes_vanish(mode):
    def fn(x, y):
        twice = x.permute(2, 0, 1).permute(1, 2, 0)               # identity overall
        moved = y.unsqueeze(0).unsqueeze(0).permute(1, 2, 0, 3)  # only size-1 dims move
        return twice * 2, moved.reshape(y.shape[0], -1) + 1, x.permute(1, 0, 2).permute(0, 2, 1) - 1

    gm, stats = run_pass(fn, torch.randn(2, 3, 4), torch.randn(5, 6), mode=mode)
    assert stats["permute_chain"] >= 2 and stats["noop_permute"] >= 1
    assert sum(1 for n in gm.graph.nodes if n.target == aten.permute.default) == 1


def test_permute_that_moves_data_is_kept_before_a_view():
    gm, stats = run_pass(lambda x: x.permute(1, 0).reshape(-1) + 1, torch.randn(3, 4))
    assert "unit_permute_view" not in stats and aten.permute.default in targets(gm)


def test_a_reshape_that_copies_a_permuted_tensor_is_kept_for_the_view_after_it():
    """permute -> reshape back to its own shape (a contiguous copy) -> view that needs the copy: the reshapes are
    neither no-ops nor collapsible into the view (the batched DSA decode graph of transformers' deepseek_v32)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from npu_graph.passes.matching.meta_refresh import refresh_meta

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    p = graph.call_function(aten.permute.default, (x, [1, 0, 2, 3]))
    r1 = graph.call_function(aten.reshape.default, (p, [3, 4, 16]))
    r2 = graph.call_function(aten.reshape.default, (r1, [12, 1, 16]))
    v = graph.call_function(aten.view.default, (r2, [3, -1, 1, 16]))
    t = graph.call_function(aten.transpose.int, (v, 1, 2))
    graph.output(graph.call_function(aten.view.default, (t, [3, 64])))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    x.meta["val"] = FakeTensorMode().from_tensor(torch.empty(4, 3, 1, 16))
    refresh_meta(gm)
    canonicalize.run(gm, PassContext(config=CompilerConfig(), machine=CPU))
    gm.recompile()
    real = torch.randn(4, 3, 1, 16)
    torch.testing.assert_close(gm(real), real.permute(1, 0, 2, 3).reshape(3, 4, 1, 16).transpose(1, 2).reshape(3, 64))

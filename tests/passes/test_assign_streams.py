"""assign_streams: stream plan, event placement (no race), identical results with one stream, and the
lightning indexer's prolog split over streams in the reference model's DSA layer."""
import copy

import pytest
import torch

import npu_graph
from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.passes import assign_streams
from npu_graph.passes.streams.cost_model import node_seconds
from npu_graph.passes.streams.deps import dependencies
from npu_graph.passes.streams.prologs import prolog_plans
from npu_graph.runtime.streams import drop_host_events, record_event, stream_of, unordered_uses, wait_event
from npu_graph.targets.description import PROFILES

aten = torch.ops.aten


def compile_watched(monkeypatch, fn, args, options):
    """Compile `fn` and return (output, report, graph after assign_streams, graph before it)."""
    seen = {}
    original = assign_streams.run

    def spy(gm, ctx):
        seen["before"] = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        result = original(gm, ctx)
        seen["after"] = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        return result

    monkeypatch.setattr(assign_streams, "run", spy)
    backend = npu_graph.Backend(npu_graph.CompilerConfig.from_options({"cache": False, "strict": True, **options}))
    with torch.no_grad():
        out = torch.compile(fn, backend=backend)(*args)
    return out, backend.reports[-1], seen["after"], seen["before"]


def two_chains(x, a, b):
    left = torch.relu(x @ a) @ a
    right = torch.tanh(x @ b) @ b
    return left + right


def chain_args():
    torch.manual_seed(0)
    return torch.randn(256, 256), torch.randn(256, 256), torch.randn(256, 256)


@pytest.fixture(scope="module")
def tiny_decode():
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named("tiny")).eval()
    return model, torch.randint(0, model.config.vocab_size, (1, 1))


def run_model(monkeypatch, model, ids, streams, **options):
    torch._dynamo.reset()
    return compile_watched(monkeypatch, model, (ids, model.new_cache(1)), {"streams": streams, **options})


def test_independent_chains_go_to_two_streams_with_events(monkeypatch):
    out, report, gm, _ = compile_watched(monkeypatch, two_chains, chain_args(), {"streams": 3})
    plan = report.extra["streams"]
    assert plan["used"] >= 2 and plan["makespan"] < plan["makespan_serial"]
    mms = [n for n in gm.graph.nodes if n.target == aten.mm.default]
    assert len({stream_of(n) for n in mms}) == 2
    assert any(n.target is wait_event for n in gm.graph.nodes)
    assert torch.equal(out, two_chains(*chain_args()))


def test_one_stream_leaves_the_graph_alone(monkeypatch):
    _, report, gm, before = compile_watched(monkeypatch, two_chains, chain_args(), {"streams": 1})
    plan = report.extra["streams"]
    assert plan["used"] == 1 and plan["makespan"] == plan["makespan_serial"] and plan["events"] == 0
    assert [n.name for n in gm.graph.nodes] == [n.name for n in before.graph.nodes]


def test_reference_model_plan_has_no_race_and_matches_one_stream(monkeypatch, tiny_decode):
    model, ids = tiny_decode
    out3, report, gm, _ = run_model(monkeypatch, model, ids, 3)
    out1, _, _, _ = run_model(monkeypatch, model, ids, 1)
    assert torch.equal(out3, out1)
    assert report.extra["streams"]["used"] == 3
    assert unordered_uses(gm.graph, dependencies(gm.graph)) == []
    waits = [n for n in gm.graph.nodes if n.target is wait_event]
    assert waits and len({n.args[0] for n in waits}) == report.extra["streams"]["events"]
    gm.graph.erase_node(waits[len(waits) // 2])
    assert unordered_uses(gm.graph, dependencies(gm.graph)), "removing a wait must expose a race"


def test_every_recorded_event_is_waited_and_follows_its_producer(monkeypatch, tiny_decode):
    model, ids = tiny_decode
    _, _, gm, _ = run_model(monkeypatch, model, ids, 3)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    records = {n.args[0]: n for n in gm.graph.nodes if n.target is record_event}
    for wait in (n for n in gm.graph.nodes if n.target is wait_event):
        record = records[wait.args[0]]
        assert order[record] < order[wait] and record.args[1] != wait.args[1]
        assert all(stream_of(p) == record.args[1] for p in record.args[2:])


@pytest.mark.parametrize(("profile", "quant"), [("npu", "none"), ("cuda", "none"), ("npu", "dsa")])
def test_indexer_prolog_splits_over_streams(monkeypatch, tiny_decode, profile, quant):
    model, ids = tiny_decode
    # the device targets keep the projections apart; the CPU's fuse_sibling_matmuls would make them one product
    _, _, _, before = run_model(monkeypatch, model, ids, 3, quant=quant, disabled_passes=["fuse_sibling_matmuls"])
    nodes = [n for n in before.graph.nodes if n.op == "call_function"]
    device = PROFILES[profile]
    cost = {n: node_seconds(n, device) for n in nodes}
    plans = prolog_plans(nodes, dependencies(before.graph), cost, 3, device.event_s)
    assert len(plans) == 2
    for plan in plans:
        # modeled: the query chain (mm -> norm -> mm -> rope -> cat) bounds the makespan at ~0.7 of the serial sum
        assert plan["makespan"] <= 0.75 * plan["serial"]
        mms = {name: s for name, s in plan["streams"].items() if name.startswith("mm")}
        assert len(mms) >= 3 and len(set(mms.values())) >= 2, "projections should not share one stream"
        assert any("mx_quant" in name for name in plan["streams"]) == (quant == "dsa")


def test_in_place_write_orders_readers_before_and_after():
    graph = torch.fx.Graph()
    buf, idx, val = graph.placeholder("buf"), graph.placeholder("idx"), graph.placeholder("val")
    read = graph.call_function(aten.sum.default, (buf,))
    view = graph.call_function(aten.view.default, (buf, [-1]))
    write = graph.call_function(aten.index_put_.default, (buf, [idx], val))
    after = graph.call_function(aten.mul.Tensor, (view, 2))
    graph.output((read, after, write))
    deps = dependencies(graph)
    assert read in deps[write] and view in deps[write]
    assert write in deps[after]


def test_cpu_lowering_drops_the_events_of_a_host_graph(monkeypatch, tmp_path):
    out, _, gm, _ = compile_watched(monkeypatch, two_chains, chain_args(), {"streams": 3, "dump_dir": str(tmp_path)})
    assert any(n.target is record_event for n in gm.graph.nodes)
    source = next(tmp_path.glob("*/compiled.py")).read_text()
    assert "record_event" not in source and "wait_event" not in source
    assert torch.equal(out, two_chains(*chain_args()))


def test_events_stay_when_a_tensor_lives_on_a_device():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2, device="meta")
    graph.call_function(record_event, (0, 0, x))
    graph.output(x)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert drop_host_events(gm) == 0
    x.meta["val"] = torch.empty(2)
    assert drop_host_events(gm) == 1 and not any(n.target is record_event for n in gm.graph.nodes)

"""partition_superkernels: region boundaries (fused ops, streams, side effects), lowering, the disk cache
and the Inductor region compiler."""
import torch

import npu_graph
from npu_graph.passes import partition_superkernels
from npu_graph.runtime.streams import EVENT_OPS, stream_of
from npu_graph.runtime.superkernel import is_region


def compile_watched(monkeypatch, fn, args, options, tmp_cache=None):
    seen = {}
    original = partition_superkernels.run

    def spy(gm, ctx):
        result = original(gm, ctx)
        seen["gm"] = gm
        seen["regions"] = {n.target: gm.get_submodule(n.target) for n in gm.graph.nodes if is_region(n)}
        return result

    monkeypatch.setattr(partition_superkernels, "run", spy)
    cache = {"cache": True, "cache_dir": str(tmp_cache)} if tmp_cache else {"cache": False}
    backend = npu_graph.Backend(npu_graph.CompilerConfig.from_options({"strict": True, **cache, **options}))
    with torch.no_grad():
        out = torch.compile(fn, backend=backend)(*args)
    return out, backend.reports[-1], seen


def norm_between(x, w):
    a = (x * 2 + 1).tanh()
    h = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    return (h * 3 - 1).sigmoid()


def norm_args():
    torch.manual_seed(0)
    return torch.randn(4, 64), torch.randn(64)


def two_chains(x, a, b):
    return torch.relu(x @ a).exp() @ a + torch.tanh(x @ b).sin() @ b


def chain_args():
    torch.manual_seed(0)
    return torch.randn(128, 128), torch.randn(128, 128), torch.randn(128, 128)


def test_fused_op_ends_regions(monkeypatch):
    out, report, seen = compile_watched(monkeypatch, norm_between, norm_args(), {})
    torch.testing.assert_close(out, norm_between(*norm_args()))
    assert report.fused_ops == {"rms_norm": 1}
    assert report.extra["superkernels"]["count"] == len(seen["regions"]) == 2
    for sub in seen["regions"].values():
        targets = [n.target for n in sub.graph.nodes if n.op == "call_function"]
        assert all(t.namespace == "aten" for t in targets if isinstance(t, torch._ops.OpOverload))
    top = [n for n in seen["gm"].graph.nodes if n.op == "call_function"]
    assert any(getattr(n.target, "_opname", "") == "rms_norm" for n in top)


def test_regions_respect_streams_and_events(monkeypatch):
    out, report, seen = compile_watched(monkeypatch, two_chains, chain_args(), {"streams": 3})
    torch.testing.assert_close(out, two_chains(*chain_args()))
    assert report.extra["streams"]["used"] >= 2
    for call in (n for n in seen["gm"].graph.nodes if is_region(n)):
        inside = [n for n in seen["regions"][call.target].graph.nodes if n.op == "call_function"]
        assert {stream_of(n) for n in inside} == {stream_of(call)}
        assert not any(n.target in EVENT_OPS or n.is_impure() for n in inside)
    streams_with_regions = {stream_of(n) for n in seen["gm"].graph.nodes if is_region(n)}
    assert len(streams_with_regions) >= 2


def test_disabled_leaves_no_regions(monkeypatch):
    out, report, seen = compile_watched(monkeypatch, norm_between, norm_args(), {"superkernel": False})
    assert report.extra["superkernels"]["count"] == 0 and not seen["regions"]
    torch.testing.assert_close(out, norm_between(*norm_args()))


def test_regions_round_trip_through_the_disk_cache(monkeypatch, tmp_path):
    first, report, _ = compile_watched(monkeypatch, norm_between, norm_args(), {}, tmp_cache=tmp_path)
    assert report.cache == "miss"
    torch._dynamo.reset()
    second, report, _ = compile_watched(monkeypatch, norm_between, norm_args(), {}, tmp_cache=tmp_path)
    assert report.cache == "hit" and report.extra["superkernels"]["count"] == 2
    assert torch.equal(first, second)


def test_inductor_region_compiler_matches(monkeypatch):
    out, report, _ = compile_watched(monkeypatch, norm_between, norm_args(), {"superkernel_compiler": "inductor"})
    assert report.extra["superkernels"]["compiler"] == "inductor"
    torch.testing.assert_close(out, norm_between(*norm_args()), rtol=1e-5, atol=1e-5)

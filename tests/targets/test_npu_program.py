"""NPU program generation on hand-annotated graphs: torch_npu calls with converted arguments, NZ weights cast
once in the prologue, stream scopes and events from node.meta["stream"] and the event nodes, super_kernel
scopes for `superkernel_N` regions; both program forms compile and pass the contract, call by call and as
source text."""
import operator

import pytest
import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import npu_graph.kernels  # noqa: F401
from npu_graph.targets import npu
from npu_graph.targets.npu_contract import NpuContractError
from tests.targets.program_calls import check_source

A, ATEN = torch.ops.ascend_dsa, torch.ops.aten


def record_event(event_id, stream, *producers):
    """Stand-in with the convention's name and module (npu_graph.runtime.streams.record_event)."""


def wait_event(event_id, stream):
    """Stand-in with the convention's name and module (npu_graph.runtime.streams.wait_event)."""


record_event.__module__ = wait_event.__module__ = "npu_graph.runtime.streams"


def annotated_graph():
    """x @ w (main stream) -> rms_norm on stream 1 -> back to main, then a SuperKernel region."""
    inner = torch.fx.Graph()
    a = inner.placeholder("a")
    inner.output(inner.call_function(ATEN.mul.Tensor, (inner.call_function(ATEN.add.Tensor, (a, a)), a)))
    graph = torch.fx.Graph()
    x, w, g = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("g")
    w.meta["layout"] = {"format": "FRACTAL_NZ", "fractal": [16, 16], "reason": "matmul weight"}
    mm = graph.call_function(ATEN.mm.default, (x, w))
    mm.meta["stream"] = 0
    graph.call_function(record_event, (0, 0, mm))
    graph.call_function(wait_event, (0, 1))
    norm = graph.call_function(A.rms_norm.default, (mm, g))
    norm.meta["stream"] = 1
    y = graph.call_function(operator.getitem, (norm, 0))
    graph.call_function(record_event, (1, 1, y))
    graph.call_function(wait_event, (1, 0))
    region = graph.call_module("superkernel_0", (y,))
    region.meta["superkernel"] = 0
    graph.output(region)
    root = torch.nn.Module()
    root.superkernel_0 = torch.fx.GraphModule(torch.nn.Module(), inner)
    gm = torch.fx.GraphModule(root, graph)
    FakeTensorProp(gm).propagate(torch.randn(8, 32, dtype=torch.bfloat16), torch.randn(32, 32, dtype=torch.bfloat16),
                                 torch.randn(32, dtype=torch.bfloat16))
    return gm


def test_streams_events_nz_and_superkernels():
    program = npu.build(annotated_graph(), "g")
    eager, graph_mode = program.sources["eager"], program.sources["torchair"]
    for source in (eager, graph_mode):
        compile(source, "npu_program", "exec")
        assert "torch_npu.npu_format_cast(w, 29)" in source and "def prologue(self, w):" in source
        assert "torch.ops.aten.mm.default(x, w_nz)" in source
        assert "torch_npu.npu_rms_norm(mm_default, g, 1e-06)" in source
    assert "with torch.npu.stream(STREAMS[1]):" in eager and "STREAMS[1].wait_event(EVENTS[0])" in eager
    assert "EVENTS[1].record(STREAMS[1])" in eager and "1: torch.npu.Stream()" in eager
    assert "with torchair.scope.npu_stream_switch('1'):" in graph_mode
    assert "torchair.scope.npu_wait_tensor(mm_default, mm_default)" in graph_mode
    assert "with torchair.scope.super_kernel('superkernel_0'):" in graph_mode
    assert "torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())" in graph_mode
    assert set(check_source(graph_mode)) >= {"torchair.scope.super_kernel", "torchair.scope.npu_stream_switch",
                                             "torch_npu.npu_format_cast", "torch_npu.npu_rms_norm"}
    assert program.nz_inputs == (1,)
    summary = program.summary()
    assert summary["stream_scopes"] >= 1 and summary["superkernel_scopes"] == 1 and summary["nz_weights"] == 1


def traced(fn, *inputs):
    gm = torch.fx.symbolic_trace(fn)
    FakeTensorProp(gm).propagate(*inputs)
    return gm


def test_quant_ops_and_dtype_adaptation():
    def quant(x, q, k, w):
        y, s = A.dynamic_mx_quant.default(x)
        b, bs = A.dynamic_block_quant.default(x)
        idx, _ = A.lightning_indexer.default(q, k, w, sparse_count=4)
        return y, s, b, bs, idx

    gm = traced(quant, torch.randn(4, 128), torch.randn(1, 8, 4, 16), torch.randn(1, 8, 1, 16), torch.randn(1, 8, 4))
    program = npu.build(gm, "q")
    source = program.sources["eager"]
    assert "dst_type=torch.float8_e4m3fn" in source and "col_block_size=128" in source
    assert "x.to(torch.bfloat16)  # adapt:" in source and "flatten(-2)[..., :(x.shape[-1] + 31) // 32]" in source
    assert {"torch_npu.npu_dynamic_mx_quant", "torch_npu.npu_dynamic_block_quant",
            "torch_npu.npu_lightning_indexer"} <= set(check_source(source))
    assert program.composites == {}


def int8_indexer(q, k, ks, w, table, lk):
    """Per-token int8 query (quantized in the graph) against a paged int8 key cache with its row scales."""
    qc, qs = A.dynamic_block_quant.default(q, block_size=128, dst_type=torch.int8)
    return A.lightning_indexer.default(qc, k, w, None, lk, table, qs, ks, layout_key="PA_BSND", sparse_count=64)


def int8_indexer_inputs():
    return (torch.randn(1, 1, 64, 128), torch.zeros(4, 128, 1, 128, dtype=torch.int8), torch.ones(4, 128, 1, 1),
            torch.randn(1, 1, 64), torch.arange(4, dtype=torch.int32).view(1, 4),
            torch.tensor([300], dtype=torch.int32))


def test_int8_indexer_maps_to_the_quantized_lightning_indexer():
    def indices_only(q, k, ks, w, table, lk):
        return int8_indexer(q, k, ks, w, table, lk)[0]

    program = npu.build(traced(indices_only, *int8_indexer_inputs()), "i")
    source = program.sources["eager"]
    assert "dst_type=torch.int8" in source and "col_block_size=128" in source
    assert "query_quant_mode=0" in source and ".squeeze(-1).to(torch.float16)" in source
    assert {"torch_npu.npu_dynamic_block_quant", "torch_npu.npu_quant_lightning_indexer"} <= set(check_source(source))
    assert "npu_lightning_indexer(" not in source and program.composites == {}


def test_int8_indexer_whose_scores_are_read_dequantizes_for_the_float_indexer():
    program = npu.build(traced(int8_indexer, *int8_indexer_inputs()), "i")
    source = program.sources["eager"]
    assert "# npu_quant_lightning_indexer returns no sparse_values" in source
    assert source.count("torch.ops.ascend_dsa.dequant_block.default(") == 2 and "return_value=True" in source
    assert "torch_npu.npu_lightning_indexer" in set(check_source(source))


def test_cases_without_counterpart_stay_labelled_composites():
    def router(x):
        return A.moe_gating_top_k.default(x, 2, norm_type=0, renorm=1)[0], A.dynamic_block_quant.default(
            torch.cat([x] * 16, -1), scale_fmt="ue8m0")[1]

    program = npu.build(traced(router, torch.randn(4, 8)), "r")
    assert set(program.composites) == {"moe_gating_top_k", "dynamic_block_quant"}
    assert "# composite: softmax routing renormalized after top-k" in program.sources["eager"]
    assert "torch.ops.ascend_dsa.moe_gating_top_k.default(x, 2, norm_type=0, renorm=1)" in program.sources["eager"]


def test_a_call_outside_the_table_fails_the_build():
    gm = traced(lambda q, k, w: A.lightning_indexer.default(q, k, w, sparse_count=4096)[0],
                torch.randn(1, 8, 4, 16, dtype=torch.bfloat16), torch.randn(1, 8, 1, 16, dtype=torch.bfloat16),
                torch.randn(1, 8, 4, dtype=torch.bfloat16))
    with pytest.raises(NpuContractError, match=r"sparse_count=4096 is outside \[1, 2048\]"):
        npu.build(gm, "bad")


def test_reduce_overhead_form_uses_tagged_events_and_aclgraph_mode():
    program = npu.build(annotated_graph(), "g", "reduce-overhead")
    source = program.sources["torchair"]
    compile(source, "npu_program_torchair", "exec")
    assert 'config.mode = "reduce-overhead"' in source and "compiler_config=config" in source
    assert "EVENTS = {0: torchair.ops.npu_create_tagged_event(tag=TAG + '_0')" in source
    wait = "with torchair.scope.npu_stream_switch('1'):\n        torchair.ops.npu_tagged_event_wait(EVENTS[0])"
    assert wait in source
    assert "torchair.ops.npu_tagged_event_record(EVENTS[0])" in source
    assert "npu_wait_tensor" not in source and "torchair.scope.super_kernel" not in source
    assert set(check_source(source)) >= {"torchair.ops.npu_create_tagged_event", "torchair.ops.npu_tagged_event_wait",
                                         "torchair.ops.npu_tagged_event_record", "torchair.get_npu_backend"}
    assert program.sources["eager"] == npu.build(annotated_graph(), "g").sources["eager"]
    assert npu.torchair_mode("reduce-overhead") == "reduce-overhead" and npu.torchair_mode("default") == "max-autotune"

"""NPU program of an expert-parallel MoE layer (moe_dispatch -> grouped_swiglu -> moe_combine, as EPExperts
builds it), generated and contract-checked, not run: the MC2 pair with the EP group's HCCL communicator name
computed once at load, npu_grouped_matmul -> npu_swiglu -> npu_grouped_matmul between them, dtype adaptations;
EP sizes or shapes MC2 does not take stay the labelled all_to_all composite, dispatch and combine alike; and
the same for a layer captured by torch.compile (target="npu"), whose program is written before it runs."""
import importlib.util
import warnings

import pytest
import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import npu_graph
from npu_graph.parallel.ep_quant import dequantize_rows  # (importing npu_graph.parallel registers the EP ops)
from npu_graph.targets import npu
from npu_graph.targets.npu_contract import Arg, NpuCall, NpuContractError, check_call
from tests.targets.program_calls import check_source

A, ATEN = torch.ops.ascend_dsa, torch.ops.aten
EXPERTS, HIDDEN, INTER, TOP_K, TOKENS = 32, 64, 16, 4, 6


def dequantize(rows, scales, dtype):
    """ep_quant.dequantize_rows as the aten ops a captured graph has."""
    wide = ATEN.mul.Tensor(ATEN._to_copy.default(rows, dtype=torch.float32), ATEN.unsqueeze.default(scales, -1))
    return ATEN._to_copy.default(wide, dtype=dtype)


def ep_layer(world: int, rank: int, quant_mode: int = 0, global_bs: int = 0):
    def layer(x, ids, weights, w13, w2):
        sent = A.moe_dispatch.default(x, ids, "7", world, rank, EXPERTS, quant_mode=quant_mode, global_bs=global_bs)
        rows = dequantize(sent[0], sent[1], x.dtype) if quant_mode == 2 else sent[0]
        out = A.grouped_swiglu.default(rows, w13, w2, sent[3])
        return A.moe_combine.default(out, ids, sent[2], sent[4], weights, "7", world, rank, EXPERTS)
    return layer


def traced(world: int, rank: int = 3, dtype: torch.dtype = torch.bfloat16, tokens: int = TOKENS,
           hidden: int = HIDDEN, **kw) -> torch.fx.GraphModule:
    local = EXPERTS // world
    gm = torch.fx.symbolic_trace(ep_layer(world, rank, **kw))
    FakeTensorProp(gm).propagate(
        torch.randn(tokens, hidden, dtype=dtype), torch.zeros(tokens, TOP_K, dtype=torch.int64),
        torch.rand(tokens, TOP_K, dtype=dtype), torch.randn(local, 2 * INTER, hidden, dtype=dtype),
        torch.randn(local, hidden, INTER, dtype=dtype))
    return gm


def test_ep_layer_lowers_to_the_mc2_pair_around_grouped_gemms():
    program = npu.build(traced(16, global_bs=16 * 8), "ep")
    assert program.composites == {}
    ops = [call.op for call in program.calls]
    assert ops == ["torch_npu.npu_moe_distribute_dispatch", "torch_npu.npu_grouped_matmul", "torch_npu.npu_swiglu",
                   "torch_npu.npu_grouped_matmul", "torch_npu.npu_moe_distribute_combine"]
    dispatch, combine = program.calls[0], program.calls[-1]
    assert [a.text for a in dispatch.args[2:]] == ["HCCL_7", "16", "3", "32"]
    assert dispatch.kwargs["global_bs"].value == combine.kwargs["global_bs"].value == 128
    assert dispatch.kwargs["expert_token_nums_type"].value == 1 and dispatch.kwargs["quant_mode"].value == 0
    for mode, source in program.sources.items():
        compile(source, f"npu_program_{mode}", "exec")
        hccl = ("HCCL_7 = torch.distributed.distributed_c10d._resolve_process_group('7')._get_backend("
                'torch.device("npu")).get_hccl_comm_name(torch.distributed.get_rank())')
        assert hccl in source and source.index(hccl) < source.index("def ")      # once, at load
        assert "ids.to(torch.int32)  # adapt: expert ids are int32" in source
        assert "weights.to(torch.float32)  # adapt: MC2 takes float32 expert_scales" in source
        assert "getitem_1 = moe_dispatch_default[3]" in source and source.count("group_list=getitem_1,") == 2
        assert set(check_source(source)) >= {"torch_npu.npu_moe_distribute_dispatch",
                                             "torch_npu.npu_moe_distribute_combine", "torch_npu.npu_swiglu"}


def test_fp32_layer_is_cast_to_bf16_for_mc2_and_back():
    source = npu.build(traced(16, dtype=torch.float32), "ep32").sources["eager"]
    assert "x.to(torch.bfloat16)  # adapt: the pinned op takes float16/bfloat16" in source
    assert "moe_dispatch_default_npu_0[0].to(torch.float32)" in source
    assert "grouped_swiglu_default.to(torch.bfloat16)" in source
    assert "moe_combine_default = moe_combine_default_npu_0.to(torch.float32)" in source
    assert "npu_grouped_matmul(\n        [getitem]," in source                # the grouped GEMMs stay fp32


def test_quantized_dispatch_keeps_int8_rows_and_scales():
    program = npu.build(traced(32, rank=31, quant_mode=2), "epq")
    dispatch = program.calls[0]
    assert dispatch.kwargs["quant_mode"].value == 2 and program.composites == {}
    assert "(moe_dispatch_default_npu_0[0], moe_dispatch_default_npu_0[1]," in program.sources["eager"]


@pytest.mark.parametrize(("kw", "reason"), [
    ({"world": 2}, "take ep_world_size in [8, 16, 32, 64, 128, 144, 256, 288] (A2: 16, 32, 64); EP=2 runs"),
    ({"world": 16, "hidden": 80}, "hidden size H in (0, 7168] and a multiple of 32; got 80"),
    ({"world": 16, "tokens": 600}, "tokens per rank BS in (0, 512]; got 600"),
])
def test_cases_mc2_does_not_take_stay_labelled_composites(kw, reason):
    world = kw.pop("world")
    program = npu.build(traced(world, rank=1, **kw), "ep_small")
    assert reason in program.composites["moe_dispatch"]
    assert program.composites["moe_combine"].startswith("its moe_dispatch stays composite: ")
    assert [call.op for call in program.calls] == ["torch_npu.npu_grouped_matmul", "torch_npu.npu_swiglu",
                                                  "torch_npu.npu_grouped_matmul"]
    source = program.sources["eager"]
    assert "torch.ops.ascend_dsa.moe_dispatch.default(x, ids, '7'," in source and "HCCL_" not in source


def _dispatch_call(**overrides) -> NpuCall:
    args = [Arg.tensor("x", torch.bfloat16), Arg.tensor("ids", torch.int32), Arg("HCCL_0", "expr"),
            Arg.literal(16), Arg.literal(0), Arg.literal(64)]
    kwargs = {"quant_mode": Arg.literal(2), "global_bs": Arg.literal(0)}
    kwargs.update(overrides)
    return NpuCall("torch_npu.npu_moe_distribute_dispatch", args, kwargs, node="d")


def test_mc2_contract():
    assert check_call(_dispatch_call()).source.endswith("torch_npu-npu_moe_distribute_dispatch.md")
    for overrides, message in (({"quant_mode": Arg.literal(1)}, "quant_mode=1 is not supported"),
                               ({"comm_alg": Arg.literal("")}, "unknown argument 'comm_alg'"),
                               ({"scales": Arg.tensor("s", torch.bfloat16)}, "'scales' has dtype bfloat16")):
        with pytest.raises(NpuContractError, match="npu_moe_distribute_dispatch"):
            check_call(_dispatch_call(**overrides))
        with pytest.raises(NpuContractError) as info:
            check_call(_dispatch_call(**overrides))
        assert message in str(info.value)
    small = _dispatch_call()
    small.args[3] = Arg.literal(2)
    with pytest.raises(NpuContractError, match=r"ep_world_size=2 is not supported"):
        check_call(small)
    fp32 = _dispatch_call()
    fp32.args[0] = Arg.tensor("x", torch.float32)
    with pytest.raises(NpuContractError, match="'x' has dtype float32"):
        check_call(fp32)


class CapturedLayer(torch.nn.Module):
    """The EPExperts forward for rank 3 of EP=16 with int8 dispatch, without a process group (the compile needs
    none; running it does)."""

    def __init__(self) -> None:
        super().__init__()
        local = EXPERTS // 16
        self.w13 = torch.nn.Parameter(torch.randn(local, 2 * INTER, HIDDEN))
        self.w2 = torch.nn.Parameter(torch.randn(local, HIDDEN, INTER))

    def forward(self, x, ids, weights):
        sent = A.moe_dispatch(x, ids, "g", 16, 3, EXPERTS, quant_mode=2)
        out = A.grouped_swiglu(dequantize_rows(sent[0], sent[1], x.dtype), self.w13, self.w2, sent[3])
        return A.moe_combine(out, ids, sent[2], sent[4], weights, "g", 16, 3, EXPERTS)


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="checks the machine without torch_npu")
def test_captured_ep_layer_npu_program(tmp_path):
    torch._dynamo.reset()
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options(
        {"cache": False, "dump_dir": str(tmp_path), "target": "npu"}))
    inputs = torch.randn(TOKENS, HIDDEN), torch.zeros(TOKENS, TOP_K, dtype=torch.int64), torch.rand(TOKENS, TOP_K)
    with torch.no_grad(), warnings.catch_warnings(), pytest.raises(ValueError, match="not initialized"):
        warnings.simplefilter("ignore")
        torch.compile(CapturedLayer(), backend=backend)(*inputs)
    extra = backend.reports[0].extra
    section = extra["npu_program"]
    assert section["unmapped_ops"] == {} and section["calls_by_op"] == {
        "torch_npu.npu_grouped_matmul": 2, "torch_npu.npu_moe_distribute_combine": 1,
        "torch_npu.npu_moe_distribute_dispatch": 1, "torch_npu.npu_swiglu": 1}
    assert extra["expert_parallel"][0]["local_experts"] == [6, 8]
    with open(section["path"]) as f:
        source = f.read()
    assert "quant_mode=2" in source and "HCCL_G = " in source
    assert len(check_source(source)) == section["op_calls"] == 5

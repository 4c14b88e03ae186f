"""The expert-parallel pieces that need no second process: per-token int8 rows, grouped_swiglu against
fused_moe, dispatch's static row bound (fake tensors), and the argument errors raised before any collective."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import npu_graph.parallel  # noqa: F401  (registers the EP ops)
from npu_graph.parallel import ep_quant
from npu_graph.parallel.ep_dispatch import row_bound
from npu_graph.parallel.ep_report import expert_parallel_summary

ops = torch.ops.ascend_dsa


def test_int8_rows_are_within_half_a_step():
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * torch.arange(1, 7).unsqueeze(1)
    x[2] = 0
    rows, scale = ep_quant.quantize_rows(x)
    assert rows.dtype == torch.int8 and scale[2] == 1 and not rows[2].any()
    back = ep_quant.dequantize_rows(rows, scale, torch.float32)
    assert ((back - x).abs() <= scale.unsqueeze(1) / 2 + 1e-6).all()
    assert (rows.abs().amax(dim=1)[[0, 1, 3, 4, 5]] == 127).all()       # each row uses the full int8 range
    packed = ep_quant.pack(rows, scale)
    assert packed.shape == (6, 44) and packed.dtype == torch.int8
    unpacked = ep_quant.unpack(packed)
    assert torch.equal(unpacked[0], rows) and torch.equal(unpacked[1], scale)


def _experts(local: int, hidden: int = 16, inter: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(local, 2 * inter, hidden, generator=g), torch.randn(local, hidden, inter, generator=g)


def test_grouped_swiglu_matches_fused_moe_and_zeroes_padding():
    w13, w2 = _experts(3)
    counts = torch.tensor([3, 0, 5])
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(2))
    out = ops.grouped_swiglu(x, w13, w2, counts)
    ids = torch.repeat_interleave(torch.arange(3), counts).unsqueeze(1)
    want = ops.fused_moe(x[:8], w13, w2, torch.ones(8, 1), ids)
    torch.testing.assert_close(out[:8], want, rtol=1e-5, atol=1e-5)
    assert not out[8:].any()


def test_grouped_swiglu_rejects_more_rows_than_given():
    w13, w2 = _experts(2)
    with pytest.raises(ValueError, match="summing to at most the 4 rows"):
        ops.grouped_swiglu(torch.randn(4, 16), w13, w2, torch.tensor([3, 2]))


@pytest.mark.parametrize(("quant_mode", "dtype"), [(0, torch.bfloat16), (2, torch.int8)])
def test_dispatch_shapes_are_static(quant_mode, dtype):
    with FakeTensorMode():
        x, ids = torch.empty(6, 16, dtype=torch.bfloat16), torch.empty(6, 3, dtype=torch.int64)
        expand_x, scales, expand_idx, token_nums, recv = ops.moe_dispatch(x, ids, "g", 4, 0, 8,
                                                                          quant_mode=quant_mode)
        combined = ops.moe_combine(expand_x.to(x.dtype), ids, expand_idx, recv, torch.empty(6, 3), "g", 4, 0, 8)
    assert expand_x.shape == (4 * 6 * 2, 16) and expand_x.dtype == dtype      # k=3 but 2 experts per rank
    assert scales.shape == ((48,) if quant_mode else (0,))
    assert expand_idx.shape == (18,) and token_nums.shape == (2,) and recv.shape == (8,)
    assert combined.shape == (6, 16) and combined.dtype == torch.bfloat16


def test_row_bound():
    assert row_bound(tokens=5, top_k=8, ep_world_size=4, moe_expert_num=64) == 4 * 5 * 8
    assert row_bound(tokens=5, top_k=8, ep_world_size=16, moe_expert_num=64) == 16 * 5 * 4
    assert row_bound(tokens=5, top_k=2, ep_world_size=2, moe_expert_num=8, global_bs=13) == 26


def test_argument_errors_before_any_collective():
    x, ids = torch.randn(4, 16), torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="moe_expert_num=6 experts cannot be split evenly over ep_world_size=4"):
        ops.moe_dispatch(x, ids, "g", 4, 0, 6)
    with pytest.raises(ValueError, match="quant_mode"):
        ops.moe_dispatch(x, ids, "g", 2, 0, 8, quant_mode=1)
    with pytest.raises(ValueError, match=r"torch\.distributed is not initialized"):
        ops.moe_dispatch(x, ids, "g", 2, 0, 8)


def test_expert_parallel_summary():
    graph = torch.fx.Graph()
    x, ids = graph.placeholder("x"), graph.placeholder("ids")
    sent = graph.call_function(ops.moe_dispatch.default, (x, ids, "g", 4, 3, 16), {"quant_mode": 2})
    sent.meta["nn_module_stack"] = {"a": ("L['self'].model", None), "b": ("L['self'].model.layers.2.mlp.experts",
                                                                           None)}
    sent.meta["val"] = (torch.empty(24, 8),)
    graph.output(sent)
    assert expert_parallel_summary(torch.fx.GraphModule(torch.nn.Module(), graph)) == [
        {"module": "model.layers.2.mlp.experts", "group": "g", "ep_world_size": 4, "ep_rank": 3, "experts": 16,
         "local_experts": [12, 16], "quant_mode": 2, "dispatch_rows": 24}]

"""The ops and native paths give the same results whatever torch's default dtype and device are: their buffers
are allocated as fp32 on the CPU, not in the defaults (a native kernel writing fp32 into a float64 buffer is
silently wrong; one writing through a meta or accelerator tensor's pointer crashes)."""
import contextlib

import pytest
import torch

from npu_graph.kernels.aten import dense_attention, depthwise_conv1d, skinny_mm

ops = torch.ops.ascend_dsa


def random(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32, device="cpu")


CALLS = {
    "skinny_mm.mm": lambda: skinny_mm.mm(random(2, 64), random(64, 48, seed=1)),
    "skinny_mm.linear": lambda: skinny_mm.linear(random(3, 64), random(40, 64, seed=1)),
    "dense_attention": lambda: dense_attention.flash_attention_for_cpu(
        random(1, 2, 80, 16), random(1, 2, 80, 16, seed=1), random(1, 2, 80, 16, seed=2), 0.0, True),
    "depthwise_conv1d": lambda: depthwise_conv1d.conv1d(
        random(1, 40, 24).transpose(1, 2), random(24, 1, 4, seed=1), None, [1], [3], [1], False, [0], 24),
    "rms_norm": lambda: ops.rms_norm(random(2, 64), random(64, seed=1), 1e-6),
    "add_rms_norm": lambda: ops.add_rms_norm(random(2, 64), random(2, 64, seed=2), random(64, seed=1), 1e-6),
    "chunk_kda prefill": lambda: ops.chunk_kda(random(1, 20, 2, 16), random(1, 20, 2, 16, seed=1),
                                               random(1, 20, 2, 8, seed=2), -random(1, 20, 2, 16, seed=3).abs(),
                                               random(1, 20, 2, seed=4).sigmoid(), output_final_state=True),
    "lightning_indexer": lambda: ops.lightning_indexer(random(1, 1, 8, 32), random(1, 300, 1, 32, seed=1),
                                                       random(1, 1, 8, seed=2), sparse_count=16),
    "sparse_flash_attention": lambda: ops.sparse_flash_attention(
        random(1, 1, 4, 32), random(1, 64, 1, 32, seed=1), random(1, 64, 1, 32, seed=1),
        torch.randperm(64, generator=torch.Generator().manual_seed(5), device="cpu")[:16].view(1, 1, 1, 16).int(),
        0.2),
    "dynamic_block_quant": lambda: ops.dynamic_block_quant(random(4, 256)),
    "dynamic_mx_quant": lambda: ops.dynamic_mx_quant(random(4, 64)),
    "moe_gating_top_k": lambda: ops.moe_gating_top_k(random(3, 16), 4, random(16, seed=1), k_group=2,
                                                     group_count=4, renorm=0, norm_type=1),
    "fused_moe": lambda: ops.fused_moe(random(2, 32), random(4, 16, 32, seed=1), random(4, 32, 8, seed=2),
                                       random(2, 2, seed=3).softmax(-1), torch.tensor([[0, 3], [1, 2]], device="cpu")),
    "attn_res": lambda: ops.attn_res(random(3, 1, 2, 32), random(1, 2, 32, seed=1), random(2, 32, seed=2),
                                     random(32, seed=3)),
    "rotary_mul": lambda: ops.rotary_mul(random(1, 1, 2, 16), random(1, 1, 1, 16, seed=1),
                                         random(1, 1, 1, 16, seed=2)),
}


def flat(result):
    return [result] if isinstance(result, torch.Tensor) else [t for r in result for t in flat(r)]


@contextlib.contextmanager
def float64_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


DEFAULTS = {"float64 dtype": float64_default, "meta device": lambda: torch.device("meta")}


@pytest.mark.parametrize("default", list(DEFAULTS))
@pytest.mark.parametrize("name", list(CALLS))
def test_same_results_under_other_defaults(name, default):
    expected = flat(CALLS[name]())
    with DEFAULTS[default]():
        got = flat(CALLS[name]())
    assert [(t.dtype, t.device) for t in got] == [(t.dtype, t.device) for t in expected]
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g.float(), e.float()) or torch.allclose(g.float(), e.float(), rtol=1e-6, atol=1e-6,
                                                                    equal_nan=True)

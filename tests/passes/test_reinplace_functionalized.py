"""reinplace_functionalized: custom ops that write their arguments (registered here with vLLM's schemas for its CPU
linear, rotary, RMSNorm and SiLU-and-mul ops) run in place, with eager's results, and copy a base only when its
old contents are read afterwards or it is the caller's tensor."""
import pytest
import torch

import npu_graph
from npu_graph.passes import reinplace_functionalized
from npu_graph.runtime import functionalized

LIB = torch.library.Library("serving_ops", "FRAGMENT")
LIB.define("linear(Tensor(a0!) out, Tensor x, Tensor weight) -> ()")
LIB.define("rotary(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, Tensor cos_sin, bool neox) "
           "-> ()")
LIB.define("rms_norm(Tensor(a!) result, Tensor input, Tensor weight, float epsilon) -> ()")
LIB.define("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) -> ()")
LIB.define("silu_and_mul(Tensor(a!) result, Tensor input) -> ()")


def _norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@torch.library.impl(LIB, "linear", "CPU")
def _linear(out, x, weight):
    torch.mm(x, weight.t(), out=out)


@torch.library.impl(LIB, "rotary", "CPU")
def _rotary(positions, query, key, head_size, cos_sin, neox):
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    for t in (query, key):
        if t is None:
            continue
        heads = t.view(t.shape[0], -1, head_size)
        first, second = heads[..., :head_size // 2].clone(), heads[..., head_size // 2:].clone()
        heads[..., :head_size // 2] = first * cos[:, None] - second * sin[:, None]
        heads[..., head_size // 2:] = second * cos[:, None] + first * sin[:, None]


@torch.library.impl(LIB, "rms_norm", "CPU")
def _rms_norm(result, x, weight, eps):
    result.copy_(_norm(x, weight, eps))


@torch.library.impl(LIB, "fused_add_rms_norm", "CPU")
def _fused_add_rms_norm(x, residual, weight, eps):
    residual.add_(x)
    x.copy_(_norm(residual, weight, eps))


@torch.library.impl(LIB, "silu_and_mul", "CPU")
def _silu_and_mul(result, x):
    half = x.shape[-1] // 2
    result.copy_(torch.nn.functional.silu(x[..., :half]) * x[..., half:])


ops = torch.ops.serving_ops


def layer(x, residual, positions, cos_sin, w_qkv, w_gate_up, w_down, w_norm):
    """A decoder layer's serving path as vLLM's CPU ops spell it: outputs written into `empty` buffers."""
    normed = torch.empty_like(x)
    ops.fused_add_rms_norm(x, residual, w_norm, 1e-6)
    ops.rms_norm(normed, x, w_norm, 1e-6)
    qkv = torch.empty(x.shape[0], w_qkv.shape[0])
    ops.linear(qkv, normed, w_qkv)
    q, k = qkv[:, :32], qkv[:, 32:48]
    ops.rotary(positions, q, k, 16, cos_sin, True)
    gate_up = torch.empty(x.shape[0], w_gate_up.shape[0])
    ops.linear(gate_up, q @ torch.ones(32, 32) + x, w_gate_up)
    act = torch.empty(x.shape[0], w_gate_up.shape[0] // 2)
    ops.silu_and_mul(act, gate_up)
    out = torch.empty(x.shape[0], w_down.shape[0])
    ops.linear(out, act, w_down)
    return out + k.sum(-1, keepdim=True), residual


def _inputs(tokens=5):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return [r(tokens, 32), r(tokens, 32), torch.arange(tokens), r(64, 16), r(64, 32), r(48, 32), r(32, 24),
            r(32)]


def compiled(fn, inputs, **options):
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False, **options}))
    eager_inputs = [t.clone() for t in inputs]
    with torch.no_grad():
        expected = fn(*eager_inputs)
        got = torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return backend, expected, got, eager_inputs


def pass_stats(backend):
    return next(p["stats"] for p in backend.reports[-1].passes if p["name"] == reinplace_functionalized.NAME)


def test_vllm_style_writes_run_in_place_with_eager_results():
    inputs = _inputs()
    backend, expected, got, eager_inputs = compiled(layer, inputs)
    torch.testing.assert_close(got, expected)
    for a, b in zip(inputs, eager_inputs):      # the caller's x and residual are written as eagerly
        torch.testing.assert_close(a, b)
    stats = pass_stats(backend)
    # fused_add_rms_norm writes the caller's x and residual: those bases are copied (AOT writes them back);
    # every call on the graph's own buffers runs in place
    assert stats["bases_copied"] == 2 and stats["calls_in_place"] == 6, stats
    assert backend.reports[-1].fallback is None


def test_a_base_read_after_the_write_is_copied():
    def fn(x, w):
        buf = x * 2
        ops.linear(buf, x, w)          # writes buf; the graph's common `x * 2` below is buf's old contents
        return buf + (x * 2).sum()

    backend, expected, got, _ = compiled(fn, [torch.randn(4, 8), torch.randn(8, 8)])
    torch.testing.assert_close(got, expected)
    assert pass_stats(backend) == {"calls_in_place": 0, "bases_copied": 1, "allocations_split": 0}


def test_a_view_read_after_the_write_sees_the_new_contents():
    def fn(x, w):
        buf = x * 2
        flat = buf.view(-1)
        ops.linear(buf, x, w)
        return buf + flat.sum()

    backend, expected, got, _ = compiled(fn, [torch.randn(4, 8), torch.randn(8, 8)])
    torch.testing.assert_close(got, expected)
    assert pass_stats(backend)["calls_in_place"] == 1


def test_a_shared_empty_buffer_is_split_per_call():
    def fn(x, w):
        a, b = torch.empty(4, 8), torch.empty(4, 8)     # AOT merges the two equal allocations
        ops.linear(a, x, w)
        first = a.relu()
        ops.linear(b, x + 1, w)
        return first + b

    backend, expected, got, _ = compiled(fn, [torch.randn(4, 8), torch.randn(8, 8)])
    torch.testing.assert_close(got, expected)
    stats = pass_stats(backend)
    assert stats["calls_in_place"] == 2 and stats["bases_copied"] == 0, stats


@pytest.mark.parametrize("only_clone", [(), (0,)])
def test_runtime_call_equals_torchs_higher_order_op(only_clone):
    base = torch.randn(6, 32)
    kwargs = dict(positions=torch.arange(6), head_size=16, cos_sin=torch.randn(8, 16), neox=True,
                  _query_base_index=0, _query_slice_dim=1, _query_slice_start=0, _query_slice_end=16,
                  _key_base_index=0, _key_alias=True, _only_clone_these_bases=only_clone)
    ours_base, theirs_base = base.clone(), base.clone()
    ours = functionalized.call(ops.rotary.default, _all_bases=[ours_base], **kwargs)
    theirs = functionalized.HOP(ops.rotary.default, _all_bases=[theirs_base], **kwargs)
    assert ours[0] is None and theirs[0] is None
    torch.testing.assert_close(ours[1], theirs[1])
    assert (ours[1] is ours_base) == (only_clone == ())

"""The CPU runtime calls fused ops' implementations directly (no dispatcher), with identical results."""
import pytest
import torch

import npu_graph
from npu_graph.runtime.direct_calls import AS_TRACED, DIRECT, PYTHON_BINDINGS, aten_callable, implementation
from npu_graph.targets.cpu_bindings import ATEN_PREFIX, FUSED_PREFIX, NATIVE_PREFIX, bind_source


def test_lowering_binds_every_call_once_in_a_header():
    source = ("def forward(self, x, g, w):\n"
              "    y = torch.ops.ascend_dsa.rms_norm.default(x, g, 1e-06)\n"
              "    z = torch.ops.aten.add.Tensor(y[0], 1)\n"
              "    return (torch.ops.aten.add.Tensor(z, x), torch.ops.aten.mm.default(z, w))\n")
    bound = bind_source(source)
    assert "torch.ops" not in bound and bound.count(f"{ATEN_PREFIX}add_Tensor(") == 2
    assert f"{FUSED_PREFIX}rms_norm = _bind.fused('rms_norm')" in bound
    assert f"{NATIVE_PREFIX}skinny_mm = _bind.native('skinny_mm', 'mm', 'default')" in bound
    assert bind_source("def forward(self, x):\n    return (x,)\n") == "def forward(self, x):\n    return (x,)\n"


def test_binders_give_what_runs_and_what_is_traced():
    assert DIRECT.fused("rms_norm") is implementation("rms_norm")
    assert AS_TRACED.fused("rms_norm") is torch.ops.ascend_dsa.rms_norm.default
    assert DIRECT.aten("add", "Tensor") is torch.add
    assert DIRECT.aten("tanh", "default") is aten_callable("tanh", "default")
    assert aten_callable("tanh", "default") is torch.ops.aten.tanh.default._op
    assert AS_TRACED.aten("add", "Tensor") is torch.ops.aten.add.Tensor
    assert AS_TRACED.native("skinny_mm", "mm", "default") is torch.ops.aten.mm.default


def test_bound_source_runs_like_the_plain_one():
    source = ("def forward(self, x, g):\n    y = torch.ops.ascend_dsa.rms_norm.default(x, g, 1e-06)\n"
              "    z = torch.ops.aten.add.Tensor(y[0], x)\n    return torch.ops.aten.view.default(z, [-1])\n")
    x, g = torch.randn(2, 8), torch.rand(8)
    results = []
    for binder in (DIRECT, AS_TRACED):
        namespace = {"torch": torch, "_bind": binder}
        exec(bind_source(source), namespace)
        results.append(namespace["forward"](None, x, g))
    plain = {"torch": torch}
    exec(source, plain)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], plain["forward"](None, x, g))


def _binding_cases() -> dict[str, list[tuple]]:
    """Arguments as generated sources pass them, per bound overload (scalars, lists, keywords, broadcasting)."""
    x, y, m = torch.randn(2, 3, 4), torch.randn(3, 4), torch.randn(2, 4, 5)
    mask, idx, cpu = y > 0, torch.tensor([[2, 0], [1, 3], [0, 0]]), torch.device("cpu")
    factory = {"dtype": torch.float32, "layout": torch.strided, "device": cpu, "pin_memory": False}
    return {
        "view.default": [(x, [6, 4]), (x, [-1])], "_unsafe_view.default": [(x, [6, 4])],
        "reshape.default": [(x, [6, 4]), (x.transpose(0, 2), [-1])], "unsqueeze.default": [(x, -1), (y, 0)],
        "squeeze.dim": [(x[:, :1], 1)], "squeeze.dims": [(x[:1, :, :1], [0, 2])],
        "mul.Tensor": [(x, y), (x, 0.125), (x.int(), 2)], "mul.Scalar": [(x, 3.0)],
        "add.Tensor": [(x, y), (x, 1e-06), ((x, y), {"alpha": 2})], "div.Tensor": [(x, y), (x, 7)],
        "sub.Tensor": [(y, x), (x, 3)], "cat.default": [([x, x], -1), ([y, y],)], "stack.default": [([y, y], 1)],
        "select.int": [(x, 1, 0), (x, -1, 3)], "bmm.default": [(x, m)], "mm.default": [(y, y.t())],
        "permute.default": [(x, [2, 0, 1])], "transpose.int": [(x, 0, 2)],
        "split_with_sizes.default": [(x, [1, 3], -1)], "sym_size.int": [(x, 2)],
        "sum.dim_IntList": [(x, [-1], True), ((x, [0, 1]), {"dtype": torch.float64})],
        "amax.default": [(x, [-1], True)],
        "pow.Tensor_Scalar": [(x, 2), (x, 0.5)], "sigmoid.default": [(x,)], "exp.default": [(x,)],
        "rsqrt.default": [(x.abs(),)], "sqrt.default": [(x.abs(),)], "log.default": [(x.abs(),)], "neg.default": [(x,)],
        "cos.default": [(x,)], "sin.default": [(x,)], "silu.default": [(x,)],
        "clone.default": [(x.transpose(0, 1),), ((x.transpose(0, 1),), {"memory_format": torch.contiguous_format})],
        "_to_copy.default": [((x.transpose(0, 1),), {"dtype": torch.int64}), ((y,), {"dtype": torch.bfloat16}),
                             ((mask,), {"dtype": torch.float32, "layout": torch.strided, "device": cpu})],
        "slice_scatter.default": [(y, y[:, :2] * 2, 1, 0, 2)], "constant_pad_nd.default": [(y, [1, 2], 0.5)],
        "embedding.default": [(y, idx % 3)], "index_select.default": [(x, -1, idx[0])], "gather.default": [(y, 1, idx)],
        "scatter.value": [(y, 1, idx, -1.0)], "where.self": [(mask, y, -y)], "where.ScalarSelf": [(mask, 2.0, y)],
        "where.ScalarOther": [(mask, y, float("-inf"))], "masked_fill.Scalar": [(y, mask, 0.0)],
        "ones.default": [(([3, 2],), factory), (([1, 1, 5],), {"dtype": torch.bool, "device": cpu})],
        "zeros.default": [(([2, 2],), factory)], "full.default": [(([2, 2], 1.5), factory)],
        "empty.memory_format": [(([0, 3],), factory)], "arange.default": [((5,), {"device": cpu, "pin_memory": False})],
        "arange.start": [((2, 7), {"dtype": torch.int32})], "scalar_tensor.default": [((float("-inf"),), factory)],
        "logical_not.default": [(mask,)], "bitwise_not.default": [(mask,)], "bitwise_and.Tensor": [(mask, ~mask)],
        "bitwise_or.Tensor": [(mask, mask)], "eq.Scalar": [(y, 0)], "le.Tensor": [(x, y)], "lt.Scalar": [(y, 0)],
        "gt.Scalar": [(y, 0.5)], "ge.Scalar": [(y, 0)],
        "native_layer_norm.default": [(x, [4], torch.ones(4), torch.zeros(4), 1e-6)],
        "_safe_softmax.default": [(x, -1)], "_softmax.default": [(x, -1, False)],
        "topk.default": [(y, 2), (y, 2, 0, False)], "sort.default": [(y,), (y, 0, True)],
    }


def _results(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


@pytest.mark.parametrize("overload", sorted(PYTHON_BINDINGS))
def test_python_bindings_equal_the_overloads(overload):
    """Every bound Python binding gives the overload's result: values, dtype, shape and strides."""
    op = getattr(getattr(torch.ops.aten, overload.split(".")[0]), overload.split(".")[1])
    for case in _binding_cases()[overload]:
        args, kwargs = case if isinstance(case[-1], dict) else (case, {})
        results = zip(_results(PYTHON_BINDINGS[overload](*args, **kwargs)), _results(op(*args, **kwargs)), strict=True)
        for got, want in results:
            if not isinstance(want, torch.Tensor):
                assert type(got) is type(want) and got == want
                continue
            assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_compiled_graph_runs_direct_calls_with_identical_results():
    gamma = torch.randn(64)

    def fn(x, y):
        h = x + y
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma

    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False}))
    x, y = torch.randn(3, 64), torch.randn(3, 64)
    with torch.no_grad():
        out = torch.compile(fn, backend=backend)(x, y)
        direct = torch.ops.ascend_dsa.add_rms_norm.default(x, y, gamma, 1e-6)
    assert backend.reports[-1].fused_ops == {"add_rms_norm": 1}
    assert torch.equal(out, direct[0])


def test_static_checks_are_skipped_only_inside_a_compiled_graph(monkeypatch):
    from npu_graph.kernels import checks
    from npu_graph.kernels.rowwise import rms_norm as rms_module

    calls = []
    monkeypatch.setattr(rms_module, "_check", lambda *a: calls.append(a))
    x, gamma = torch.randn(2, 8), torch.rand(8)
    torch.ops.ascend_dsa.rms_norm(x, gamma)
    assert len(calls) == 1
    with checks.shapes_checked_at_trace():
        torch.ops.ascend_dsa.rms_norm(x, gamma)
        assert not checks.static_checks_needed()
    assert len(calls) == 1 and checks.static_checks_needed()


def test_data_checks_still_run_in_compiled_graphs():
    def route(x, w13, w2, weights, ids):
        return torch.ops.ascend_dsa.fused_moe(x, w13, w2, weights, ids)

    args = (torch.randn(2, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 3), torch.rand(2, 1),
            torch.tensor([[0], [1]], dtype=torch.int32))
    compiled = torch.compile(route, backend=npu_graph.get_backend({"cache": False, "strict": True}))
    compiled(*args)
    with pytest.raises(ValueError, match="topk_ids"):
        compiled(*args[:4], torch.tensor([[0], [9]], dtype=torch.int32))


def test_a_direct_fused_call_takes_dtypes_as_the_scalar_type_codes_inductor_writes():
    """Inductor's generated module passes `dst_type=24`; the dispatcher turns such codes into dtypes, and so must
    the direct binding that bypasses it."""
    quant = DIRECT.fused("dynamic_block_quant")
    x = torch.randn(3, 64)
    for dtype in (torch.int8, torch.float8_e4m3fn):
        want = torch.ops.ascend_dsa.dynamic_block_quant.default(x, block_size=64, dst_type=dtype)
        got = quant(x, block_size=64, dst_type=_SCALAR_TYPE_CODES[dtype])
        assert got[0].dtype == dtype and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


_SCALAR_TYPE_CODES = {torch.int8: 1, torch.float8_e4m3fn: 24}     # c10::ScalarType's values (fixed by its ABI)
